"""pykvcache as a vLLM offloading spec.

Select it with ``kv_connector="OffloadingConnector"`` and, in
``kv_connector_extra_config``, ``"spec_name": "NvmeOffloadingSpec",
"spec_module_path": "pykvcache.vllm"`` plus the pykvcache keys (see docs/vllm.md).
For lookahead preloading use ``kv_connector="PyKvCacheConnector"`` with
``kv_connector_module_path="pykvcache.vllm"`` instead (docs/lookahead.md).

The spec is imported lazily so that :mod:`pykvcache.vllm.config` and friends
can be used (and tested) without loading vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NvmeOffloadingSpec", "PyKvCacheConnector", "ConfigError", "parse_extra_config"]


def __getattr__(name: str) -> Any:
    if name == "NvmeOffloadingSpec":
        from pykvcache.vllm.spec import NvmeOffloadingSpec

        return NvmeOffloadingSpec
    if name == "PyKvCacheConnector":
        from pykvcache.vllm.connector import PyKvCacheConnector

        return PyKvCacheConnector
    if name in ("ConfigError", "parse_extra_config"):
        from pykvcache.vllm import config

        return getattr(config, name)
    raise AttributeError(f"module 'pykvcache.vllm' has no attribute {name!r}")
