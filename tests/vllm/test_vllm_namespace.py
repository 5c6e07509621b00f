"""Namespace fingerprints: every layout-relevant difference separates chunks."""

from __future__ import annotations

import dataclasses
import re

import pytest
from pykvcache.vllm.identity.namespace import NamespaceInputs, namespace_for
from pykvcache.vllm.layout import ChunkLayout, staging_shm_name


def _inputs(**changes) -> NamespaceInputs:
    base = NamespaceInputs(
        model="/models/Llama-3.2-3B",
        dtype="bfloat16",
        kv_cache_layout="LBHNC",
        canonical_layout=False,
        replicated_layout=False,
        groups=((0, 16, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")),),
        tokens_per_hash=16,
        blocks_per_chunk=16,
        bytes_per_block=16 * 114688,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        format_version=1,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/Qwen3-4B"},
        {"dtype": "float16"},
        {"kv_cache_layout": "HND"},
        {"canonical_layout": True},
        {"blocks_per_chunk": 8},
        {"tokens_per_hash": 32},
        {"groups": ((0, 32, ("model.layers.0.self_attn.attn",)),)},
        {"bytes_per_block": 1},
        {"world_size": 2, "tp_size": 2},
        {"pp_size": 2},
        {"dcp_size": 2},
        {"format_version": 2},
        {"row_layout_version": 2},
        {"salt": "weights-v2"},
    ],
)
def test_any_relevant_difference_changes_namespace(change):
    assert namespace_for(_inputs(**change)) != namespace_for(_inputs())


def test_namespace_is_stable_and_path_safe():
    ns = namespace_for(_inputs())
    assert ns == namespace_for(_inputs())
    assert re.fullmatch(r"[A-Za-z0-9._-]+", ns)
    assert ns.startswith("Llama-3.2-3B-bfloat16-")
    weird = namespace_for(_inputs(model="org/we ird:name/"))
    assert re.fullmatch(r"[A-Za-z0-9._-]+", weird)


def test_from_vllm_config_ignores_rank_and_data_parallel_index():
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    def config(rank: int, dp_index: int, dtype: str = "float32") -> OffloadingConfig:
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(32, ("l0", "l1"), 0),),
            worker_kv_bytes_per_block=65536,
            enable_kv_cache_events=False,
            extra_config={},
            engine_id="e",
            model=OffloadingModelConfig("/m/tiny", dtype),
            cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
            parallel=OffloadingParallelConfig(
                rank=rank,
                world_size=2,
                tp_size=2,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=dp_index,
                data_parallel_size=2,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=False,
            ),
            kv_cache_layout="LBHNC",
        )

    def ns(cfg, **kw):
        return namespace_for(NamespaceInputs.from_offloading_config(cfg, format_version=1, **kw))

    # One chunk file holds every rank's row, and DP replicas serve one model.
    assert ns(config(0, 0)) == ns(config(1, 1))
    assert ns(config(0, 0)) != ns(config(0, 0, dtype="bfloat16"))
    assert ns(config(0, 0), model_id="tiny@v1") != ns(config(0, 0))
    assert ns(config(0, 0), model_id="tiny@v1").startswith("tiny_v1-float32-")


def test_chunk_layout_rows_per_rank():
    layout = ChunkLayout(blocks_per_chunk=2, bytes_per_block=65536 + 10, world_size=4)
    assert layout.row_bytes == 2 * 65546
    assert layout.row_stride % 4096 == 0 and layout.row_stride >= layout.row_bytes
    assert layout.payload_bytes == 4 * layout.row_stride
    assert [layout.row_offset(r) for r in range(4)] == [0, layout.row_stride, 2 * layout.row_stride, 3 * layout.row_stride]
    with pytest.raises(ValueError):
        layout.row_offset(4)
    with pytest.raises(ValueError, match="no KV cache"):
        ChunkLayout(blocks_per_chunk=1, bytes_per_block=0, world_size=1)


def test_shm_name_is_shared_by_engine_and_distinct_between_engines():
    a = staging_shm_name("1d40428e-3474-40d7", "ns")
    assert a == staging_shm_name("1d40428e-3474-40d7", "ns")
    assert a != staging_shm_name("other-engine", "ns")
    assert a != staging_shm_name("1d40428e-3474-40d7", "ns2")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", a) and len(a) < 80
