"""The vLLM OffloadingSpec: wires configuration, namespace, staging and store.

vLLM instantiates it in the scheduler process (``get_manager``) and in every
worker (``get_worker``); the API server only calls ``build_metric_definitions``.
Nothing heavy happens at import or in ``__init__``: the staging region and the
store are created by the scheduler in ``get_manager``.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadingSpec

from pykvcache.vllm.config import (
    ConfigError,
    PykvcacheConfig,
    lookahead_budget_bytes,
    lookup_hold_budget_bytes,
    validate_extra_config,
)
from pykvcache.vllm.host_config import find_vllm_config, steps_reported
from pykvcache.vllm.layout import ChunkLayout, staging_shm_name
from pykvcache.vllm.logs import route_engine_logs
from pykvcache.vllm.metrics import metric_definitions
from pykvcache.vllm.scheduler import disk_tier
from pykvcache.vllm.scheduler.gating import GateHooks, Gating, GatingFactory
from pykvcache.vllm.staging_sizing import staging_sizing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingMetricMetadata
    from vllm.v1.kv_offload.config import OffloadingConfig

    from pykvcache._core import BlockStore, StagingPool
    from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager
    from pykvcache.vllm.worker.staging_worker import StagingWorker

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

route_engine_logs()

#: The fewest staging slots that let one chunk be written while another loads.
MIN_STAGING_SLOTS = 4


def parallelism_agnostic(config: OffloadingConfig, vllm_config: VllmConfig | None) -> bool:
    """Whether chunks can be shared across tensor-parallel sizes: asked for
    (``canonical_layout``) and certified by vLLM (``is_parallelism_agnostic``:
    one full-attention group, KV heads sharded exactly over TP, no context
    parallelism, no per-token quantisation scales), with the head count known.
    Otherwise the per-rank layout and its strict fingerprint stay."""
    if not getattr(config, "canonical_layout", False):
        return False
    par = config.parallel
    why = None
    if not par.is_parallelism_agnostic:
        why = "vLLM does not certify this KV cache as parallelism-agnostic"
    elif par.world_size != par.tp_size or par.pcp_size != 1 or par.dcp_size != 1:
        why = "only tensor parallelism can change (world size = TP size, no context parallelism)"
    elif vllm_config is None:
        why = "the engine's VllmConfig (KV head count) was not found"
    if why is not None:
        logger.info(
            "pykvcache: canonical_layout requested but %s: chunks keep the per-rank layout and a namespace per parallel configuration", why
        )
        return False
    return True


def canonical_head_shards(config: OffloadingConfig, vllm_config: VllmConfig) -> int:
    """How many distinct KV head shards the ranks hold: vLLM's canonical page is
    that many local pages (TP ranks beyond the head count replicate heads)."""
    total = vllm_config.model_config.get_total_num_kv_heads()
    return min(config.parallel.tp_size, total)


class NvmeOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # Runs in the front-end process, but only once the engine is up (vLLM
        # builds its stat loggers after the engine core handshake): the early
        # check is pykvcache.vllm.kv_transfer_config and, on CUDA,
        # PyKvCacheConnector.requires_piecewise_for_cudagraph.
        validate_extra_config(extra_config)
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # Found now, while vLLM is constructing the spec; read in get_manager.
        self._vllm_config = find_vllm_config()
        self.parallelism_agnostic = parallelism_agnostic(config, self._vllm_config)
        if self.parallelism_agnostic:
            assert self._vllm_config is not None  # parallelism_agnostic: the head count is known
            # One canonical row that every rank shares: the chunk's bytes are
            # the same at any TP size, so the namespace leaves the sizes out.
            self.layout = ChunkLayout(
                blocks_per_chunk=self.blocks_per_chunk,
                bytes_per_block=config.worker_kv_bytes_per_block * canonical_head_shards(config, self._vllm_config),
                world_size=1,
                ranks_share_row=True,
            )
        else:
            self.layout = ChunkLayout(
                blocks_per_chunk=self.blocks_per_chunk,
                bytes_per_block=config.worker_kv_bytes_per_block,
                world_size=config.parallel.world_size,
            )
        # Every problem at once: the keys, the host, and what the chunk size
        # makes of staging_bytes and capacity_bytes (the first moment it is known).
        self.settings: PykvcacheConfig = validate_extra_config(
            self.extra_config,
            more=lambda values: disk_tier.staging_size_problems(
                values.get("staging_bytes"), values.get("capacity_bytes"), self.layout.payload_bytes, min_slots=MIN_STAGING_SLOTS
            ),
        )
        self.offload_prompt_only = self.settings.offload_prompt_only
        self._namespace: str | None = None
        # The staging region belongs to this engine only: its name needs the
        # engine id, not the model's identity (which workers never compute).
        self.shm_name = staging_shm_name(config.engine_id, self._namespace_for(model_identity=""))
        slots = disk_tier.size_staging(self.settings, self.layout.payload_bytes, min_slots=MIN_STAGING_SLOTS)
        self.num_slots = slots.num_slots
        self.slot_footprint = slots.slot_footprint
        self.chunk_tokens = self.blocks_per_chunk * (self.tokens_per_block[0] if self.tokens_per_block else 1)
        self._manager: NvmeOffloadingManager | None = None
        self._worker: StagingWorker | None = None

    def _namespace_for(self, model_identity: str) -> str:
        bytes_per_block = self.layout.bytes_per_block
        return disk_tier.chunk_namespace(
            self.config,
            self.settings,
            model_identity,
            (lambda inputs: inputs.parallelism_agnostic(bytes_per_block)) if self.parallelism_agnostic else None,
        )

    @property
    def namespace(self) -> str:
        """Where this engine's chunks live: layout + the model's identity
        (resolved config and weights digest). Computed once, in the scheduler
        process, before the store opens: no chunk is looked up before it is
        known (a node's first start reads every byte of the weights, seconds
        for a 16 GB model; later starts a stat per file; decision 0052)."""
        if self._namespace is None:
            self._namespace = self._namespace_for(disk_tier.model_identity_digest(self._vllm_config, self.config.model.name, self.settings))
        return self._namespace

    def _gating(self, steps_timed: bool) -> GatingFactory:
        """Builds the break-even gate and store admission (:func:`~pykvcache.vllm.scheduler.gate_plan.build_gating`)
        once the manager's store is open; ``steps_timed``: the connector reports the engine's steps."""
        from pykvcache.vllm.scheduler.gate_plan import build_gating

        def gating(hooks: GateHooks) -> Gating:
            return build_gating(
                self.settings,
                hooks,
                model=self.config.model.name,
                dtype=str(self.config.model.dtype),
                chunk_bytes=self.layout.payload_bytes,
                chunk_tokens=self.chunk_tokens,
                steps_timed=steps_timed,
            )

        return gating

    def _open_store(self, pool: StagingPool, *, close_pool_on_failure: bool = False) -> BlockStore:
        return disk_tier.open_store(self.settings, pool, self.namespace, close_pool_on_failure=close_pool_on_failure)

    def get_manager(self) -> NvmeOffloadingManager:
        if self._manager is None:
            from pykvcache._core import StagingPool

            # With LoRA, chunk keys carry each adapter's content digest.
            from pykvcache.vllm.scheduler.adapter_keys import manager_class

            pool = self._create_pool(StagingPool)
            # The engine creates missing roots (0o700; see disk_tier.open_store).
            store = self._open_store(pool, close_pool_on_failure=True)
            if self.settings.preformat is True:
                self._preformat(store, pool)
            self._manager = manager_class(self._vllm_config)(
                pool=pool,
                store=store,
                layout=self.layout,
                reopen_store=(lambda: self._open_store(pool)) if self.settings.wipe_on_reset else None,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                max_inflight_writes=self.settings.max_inflight_writes,
                # PyKvCacheConnector builds this manager (inside its base class) and reports the steps.
                gating=self._gating(steps_timed=steps_reported()),
                chunk_tokens=self.chunk_tokens,
                lookahead_slots=lookahead_budget_bytes(self.settings) // self.slot_footprint,
                lookahead_requests=self.settings.lookahead_requests,
                lookup_hold_slots=lookup_hold_budget_bytes(self.settings) // self.slot_footprint,
            )
            logger.info(
                "pykvcache: namespace %s on %s: capacity_bytes %d (%.2f GiB; keeps %s free on "
                "the filesystem), %d chunk(s) found using %d bytes; staging_bytes %d (%.1f MiB): "
                "%d slots of %d bytes of KV; backend %s, direct I/O %s, fixed buffers %s",
                self.namespace,
                ", ".join(self.settings.storage_dirs),
                store.capacity_bytes,
                store.capacity_bytes / (1 << 30),
                " + ".join(f"{b / (1 << 30):.2f} GiB" for b in store.stats()["min_free_bytes"]),
                len(store),
                store.used_bytes,
                self.settings.staging_bytes,
                self.settings.staging_bytes / (1 << 20),
                self.num_slots,
                self.layout.payload_bytes,
                store.backend,
                store.direct_io,
                store.fixed_buffers,
            )
            self._advise_staging_size()
            if self.settings.preformat == "background":
                free = store.capacity_bytes - store.committed_bytes
                if free >= self.slot_footprint:
                    logger.info("pykvcache: preformatting %.1f MiB in the background (preformat: background)", free / (1 << 20))
                    self._manager.start_background_preformat()
        return self._manager

    def _advise_staging_size(self) -> None:
        model_config = getattr(self._vllm_config, "model_config", None)
        sizing = staging_sizing(
            slots=self.num_slots,
            slot_bytes=self.slot_footprint,
            lookahead_slots=lookahead_budget_bytes(self.settings) // self.slot_footprint,
            max_model_len=getattr(model_config, "max_model_len", None),
            chunk_tokens=self.chunk_tokens,
            groups=max(1, len(self.tokens_per_block)),
        )
        for line in sizing.advice():
            logger.warning("pykvcache: %s", line)

    def _create_pool(self, staging_pool_cls: type[StagingPool]) -> StagingPool:
        """The staging region: a memfd, so it never outlives the engine (vLLM
        SIGKILLs the EngineCore at shutdown; no destructor runs), reserved in
        full now so that a size the host cannot give fails here, once."""
        from pykvcache._core import StoreError

        try:
            return staging_pool_cls(self.layout.payload_bytes, self.num_slots, shm_name=self.shm_name, memfd=True)
        except StoreError as exc:
            if exc.errno not in (errno.ENOMEM, errno.ENOSPC):
                raise
            raise ConfigError(
                f"staging_bytes={self.settings.staging_bytes} ({self.num_slots} slots, "
                f"{self.num_slots * self.slot_footprint / (1 << 20):.1f} MiB) cannot be reserved, "
                f"lower it: {exc.strerror}"
            ) from exc

    def _preformat(self, store: BlockStore, pool: StagingPool) -> None:
        """Writes filler chunks up to capacity_bytes before serving starts, so
        that the first fill overwrites allocated files (see pykvcache.preformat).
        One-time: a later start finds the store full (fillers or chunks) and
        writes nothing; an interrupted one continues where it stopped."""
        from pykvcache.preformat import preformat

        free = store.capacity_bytes - store.committed_bytes
        if free < self.slot_footprint:
            return
        logger.info(
            "pykvcache: preformatting %.1f MiB of %s (preformat: true; one-time)", free / (1 << 20), ", ".join(self.settings.storage_dirs)
        )
        next_report = [0.1]

        def progress(done: int, total: int) -> None:
            if done >= next_report[0] * total:
                logger.info("pykvcache: preformat %.0f%% (%d of %d bytes)", 100 * done / total, done, total)
                next_report[0] += 0.1

        try:
            report = preformat(
                store, pool, queue_depth=min(8, self.num_slots), max_seconds=self.settings.preformat_max_s, progress=progress
            )
        except OSError as exc:
            # Only an optimisation: serve without it (what was written stays fillers).
            logger.warning("pykvcache: preformat stopped: %s; serving continues", exc)
            return
        left = store.capacity_bytes - store.committed_bytes
        logger.info(
            "pykvcache: preformat wrote %d filler chunk(s), %.2f GB in %.1f s (%.2f GB/s)%s",
            report.chunks,
            report.bytes / 1e9,
            report.seconds,
            report.gb_per_s,
            f"; stopped at preformat_max_s, {left / 1e9:.2f} GB left for the next start" if left >= self.slot_footprint else "",
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> StagingWorker:
        if self._worker is None:
            from pykvcache.vllm.worker.staging_worker import StagingWorker

            self._worker = StagingWorker(kv_caches, self.layout, self.shm_name, rank=self.config.parallel.rank)
        return self._worker
