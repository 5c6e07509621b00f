"""pykvcache's tier end to end under vLLM's tiering spec, where the platform
lets that spec run: vLLM's ``TieringOffloadingSpec`` (its CPU tier in front)
with ``PykvcacheTier`` as the secondary tier, by module path. One engine
stores a prefix; a second engine on the same directory (empty CPU tier)
serves it from pykvcache's tier with identical greedy tokens.

vLLM's CPU build refuses the tiering spec in every worker (its ``get_worker``
raises on the CPU platform): that refusal, its exact text, is the skip reason
(probed in-process through the same ``get_worker``, before any engine starts).
"""

from __future__ import annotations

import pytest
from test_vllm_e2e import _run, _texts
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE


def _refusal(tmp_path) -> str | None:
    """What vLLM's tiering spec says when a worker asks it for its worker here
    (None where the platform lets it build one)."""
    import dataclasses

    from offloading_configs import tiny_offloading_config
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.base import CanonicalKVCaches
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    config = tiny_offloading_config({})
    config = dataclasses.replace(config, extra_config={"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2, "secondary_tiers": []})
    try:
        TieringOffloadingSpec(config).get_worker(CanonicalKVCaches(tensors=[], group_data_refs=[]))
    except Exception as exc:  # noqa: BLE001 - its text is the report
        return f"{type(exc).__name__}: {exc}"
    return None


def test_the_tier_serves_a_stored_prefix_to_a_new_engine(tiny_model, tmp_path):
    refusal = _refusal(tmp_path)
    if refusal is not None:
        pytest.skip(f"vLLM's TieringOffloadingSpec refuses this platform in its workers: {refusal}")
    store = tmp_path / "store"
    tier = {
        "type": "PykvcacheTier",
        "module_path": "pykvcache.vllm.tier",
        "storage_dirs": [str(store)],
        "capacity_bytes": "1GiB",
        "staging_bytes": "16MiB",
    }
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 << 20,
            "block_size": 64,
            "secondary_tiers": [tier],
        },
    }
    xs, _, _ = _texts()

    def scenario(phases):
        return {"model": tiny_model, "phases": phases, "llm": {"kv_transfer_config": kv}}

    first = _run(scenario([{"op": "generate", "name": "x", "prompts": [xs[0]]}, {"op": "settle"}]), tmp_path, "tier-first")
    second = _run(scenario([{"op": "generate", "name": "x", "prompts": [xs[0]]}]), tmp_path, "tier-second")
    stored, served = first["by_name"]["x"], second["by_name"]["x"]
    assert served["num_cached_tokens"][0] >= 800
    assert served["metrics"].get("vllm:pykvcache_disk_reads", 0) >= 12
    assert served["tokens"][0] == stored["tokens"][0]
    assert list(store.rglob("*.kvc"))
