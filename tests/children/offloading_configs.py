"""A real vLLM ``OffloadingConfig`` for the tiny model's geometry (two layers,
one KV group, 32-token blocks, 2 blocks per chunk), as vLLM would hand it to
pykvcache's spec: for spec and manager tests that start no engine."""

from __future__ import annotations

from typing import Any


def tiny_offloading_config(extra: dict[str, Any], *, engine_id: str = "e", bytes_per_block: int = 65536) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm", "blocks_per_chunk": 2, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig("/m/tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="LBHNC",
    )
