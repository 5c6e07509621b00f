"""What a cluster is made of: its nodes' vLLM and pykvcache settings, and the router's.

Every node serves the same model with pykvcache on the same store directory (a shared
filesystem mounted on every node, or a local directory when the nodes share one host) and
publishes its KV events over ZMQ; ``vllm-router`` reads them. The settings that must agree
between the nodes and the router (the model's name, vLLM's block size, the event endpoints)
are derived here from one :class:`ClusterSpec`, so they cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pykvcache.vllm.config import kv_transfer_config

#: The router policies a cluster may run (vllm-router 0.1.17's names).
POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two", "random")
#: vllm-router pinned by ``dev/setup_router.sh``; the one whose event handling is documented.
ROUTER_VERSION = "0.1.17"


@dataclass
class ClusterSpec:
    """One cluster's configuration; ``nodes`` servers and a router on ``host``."""

    model: str
    store: Path | None  # the shared store directory; None: the nodes run without pykvcache
    # The same store seen through other mounts of its filesystem on this host: node i uses
    # views[i % len(views)] (one machine standing in for several, each node its own
    # filesystem client, as the test suite's GlusterFS volume). Empty: every node uses `store`.
    store_views: list[Path] = field(default_factory=list)
    nodes: int = 2
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    router_port: int = 0  # 0: a free port
    capacity_bytes: int | str = "8GiB"
    staging_bytes: int | str = "256MiB"
    # pykvcache's chunk, in tokens: a multiple of vLLM's block size.
    chunk_tokens: int = 64
    # vLLM's KV block size, which the router must hash prompts by as well.
    block_size: int = 32
    # A shared store's chunk is as near to every node as to the one that wrote it, so the
    # router gives disk-tier blocks no credit by default: a prefix only the store holds goes
    # to whichever node the load picks (decision 0085).
    kv_penalty_disk: float = 0.0
    vllm_args: list[str] = field(default_factory=list)  # beyond model, host, port, block size, events
    extra_config: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config keys
    router_path: str | None = None  # PYTHONPATH of a private vllm-router install
    router_metrics_port: int | None = None  # the router's Prometheus endpoint; None: off
    router_extra_args: list[str] = field(default_factory=list)  # more vllm-router arguments
    log_dir: Path = Path("cluster-logs")

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {self.nodes}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.block_size <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of block_size ({self.block_size})")
        if not 0.0 <= self.kv_penalty_disk <= 1.0:
            raise ValueError(f"kv_penalty_disk must be within 0..1, got {self.kv_penalty_disk}")
        if self.store is not None and not Path(self.store).is_dir():
            raise ValueError(f"store {self.store}: not a directory (create it on the shared filesystem first)")
        if self.store_views and self.store is None:
            raise ValueError("store_views without a store: the views are of the store")
        for view in self.store_views:
            if not Path(view).is_dir():
                raise ValueError(f"store view {view}: not a directory (the store seen through another mount)")

    @property
    def uses_events(self) -> bool:
        return self.policy == "kv_aware"

    def store_for(self, index: int) -> Path | None:
        """The directory node ``index`` reads and writes the store through."""
        if self.store is None or not self.store_views:
            return self.store
        return Path(self.store_views[index % len(self.store_views)])

    def kv_transfer(self, index: int = 0) -> dict[str, Any] | None:
        """Node ``index``'s ``--kv-transfer-config``: pykvcache's connector on the shared store,
        announcing the chunks it wrote (``self_describing_kv_events``: vLLM 0.32 publishes no
        offloading event without it)."""
        store = self.store_for(index)
        if store is None:
            return None
        return kv_transfer_config(
            [str(store)],
            self.capacity_bytes,
            lookahead=True,
            staging_bytes=self.staging_bytes,
            block_size=self.chunk_tokens,
            self_describing_kv_events=True,
            **self.extra_config,
        )

    def node_args(self, events_endpoint: str | None) -> list[str]:
        """vLLM arguments beyond ``--model/--host/--port`` and ``--kv-transfer-config``."""
        args = ["--block-size", str(self.block_size), "--enable-prefix-caching"]
        if events_endpoint is not None:
            # vLLM's publisher binds only a wildcard address (it connects to any other), so it
            # listens on every interface at the node's event port; the router connects to it.
            port = events_endpoint.rsplit(":", 1)[1]
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": ""}
            args += ["--kv-events-config", json.dumps(events), "--prefix-caching-hash-algo", "sha256_cbor"]
        return args + list(self.vllm_args)

    def node_env(self) -> dict[str, str]:
        """What the router needs of vLLM's block hashes: the router hashes a request's
        tokens as vLLM does, from the same seed, and reads the hashes as bytes."""
        if not self.uses_events:
            return {}
        return {"PYTHONHASHSEED": "0", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}

    @property
    def served_name(self) -> str:
        return self.model

    def router_args(self, workers: dict[str, str | None]) -> list[str]:
        """``vllm-router`` arguments for ``workers`` (URL -> ZMQ endpoint or None)."""
        # A dead node leaves the rotation after two failed health checks a second apart (the
        # default: three, a minute apart); a request sent to it meanwhile is retried on another.
        args = ["--policy", self.policy, "--worker-urls", *workers, "--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        if self.uses_events:
            args += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.served_name]
            args += ["--kv-penalty-disk", str(self.kv_penalty_disk)]
            for url, endpoint in workers.items():
                if endpoint is not None:
                    args += ["--kv-event-source", f"{url}={endpoint}"]
        if self.router_metrics_port is not None:
            args += ["--prometheus-host", self.host, "--prometheus-port", str(self.router_metrics_port)]
        return args + list(self.router_extra_args)
