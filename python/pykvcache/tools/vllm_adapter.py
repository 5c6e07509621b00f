"""The one place the tools reach into objects that have no public API for it.

vLLM's ``LLM`` exposes neither its configuration, nor an explicit shutdown,
nor the scheduler-side objects a connector builds; its filesystem tier keeps
its O_DIRECT choice and thread pool private; pykvcache's own manager is built
by the connector inside the EngineCore. The characterization harness and
calibration need all of these, so they are reached here and only here
(``tests/tools/test_tools_layering.py`` checks it): when vLLM renames an attribute,
or the manager's gate wiring changes, this module is what changes.
"""

from __future__ import annotations

from typing import Any


# ----------------------------------------------------------------------
# vLLM's LLM
# ----------------------------------------------------------------------
def engine_config(llm: Any) -> Any:
    """The engine's resolved ``VllmConfig`` (block size, dtype, parallelism)."""
    return llm.llm_engine.vllm_config


def shutdown(llm: Any) -> None:
    """Stop the engine now: pykvcache flushes pending writes and unlinks its
    staging region before the next engine of the same process starts."""
    llm.llm_engine.engine_core.shutdown()


def pykvcache_manager(llm: Any) -> Any:
    """pykvcache's scheduler-side manager inside this process's EngineCore."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    connector = getattr(scheduler, "connector", None)
    manager = getattr(connector, "_manager", None)
    if manager is None:
        raise RuntimeError(
            "pykvcache's manager is not reachable: the EngineCore must run in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0) with PyKvCacheConnector"
        )
    return manager


# ----------------------------------------------------------------------
# pykvcache's manager (scheduler side)
# ----------------------------------------------------------------------
def gate_wired(manager: Any) -> bool:
    return getattr(manager.gating, "gate", None) is not None  # NoGating has no gate


def request_gate(manager: Any) -> Any:
    """The gate deciding requests' loads."""
    return manager.gating.gate


def use_gates(manager: Any, request_gate: Any, preload_gate: Any) -> None:
    """Swap the gates of requests and of the lookahead preloader. The
    device's busy period so far is forgotten: what it timed belongs to the
    gate swapped out (an emulated slow device's reads must not teach the
    next mode's gate; decision 0079)."""
    manager.gating.gate = request_gate
    manager.gating.preload_gate = preload_gate
    manager.gating.busy.clear()


def store_of(manager: Any) -> Any:
    return manager.store


def use_store(manager: Any, store: Any) -> None:
    """Serve the manager's reads and writes through ``store`` (e.g. a wrapper
    that delays completions) from the next operation on."""
    manager.store = store


# ----------------------------------------------------------------------
# vLLM's filesystem tier
# ----------------------------------------------------------------------
def fs_tier_info(tier: Any) -> dict[str, Any]:
    """What a ``FileSystemTierManager`` chose: O_DIRECT, and its I/O threads."""
    return {"o_direct": tier._use_o_direct, "threads": len(tier._pool._threads)}
