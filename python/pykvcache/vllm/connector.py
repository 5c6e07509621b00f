"""vLLM's OffloadingConnector plus lookahead: every request is seen at arrival.

The stock connector forwards only a request's id to the manager at arrival,
and vLLM probes waiting requests only when its scheduling loop reaches them
(none at all while the running batch is full). This subclass computes the
request's chunk keys from ``request.block_hashes`` exactly as vLLM does later
(``RequestOffloadState.update_offload_keys``: the hash of each chunk's last
hash-block plus the group index) and queues them in the manager's preloader,
which stages the head of the waiting queue ahead of the scheduler.

Select it with ``"kv_connector": "PyKvCacheConnector",
"kv_connector_module_path": "pykvcache.vllm"``; ``spec_name`` and
``spec_module_path`` default to pykvcache's spec. A request can opt out with
``kv_transfer_params={"pykvcache_lookahead": false}``. It also times the
engine's steps for the gate's prefill side (:class:`pykvcache.vllm.scheduler.step_timer.StepTimer`).

It also lets a lookup answer HIT for chunks whose disk reads are in flight
(decision 0055): the worker copies each chunk once its slot's ready word
says verified (polled at each step, decision 0065), and a
load whose read failed is reported to vLLM as a failed receive
(``failed_recving``), which vLLM recomputes under
``kv_load_failure_policy="recompute"`` - the policy this connector sets. The
stock ``OffloadingConnector`` asserts that every transfer succeeds and
reports no failed loads, so with it lookups keep answering HIT_PENDING.
"""

from __future__ import annotations

import logging
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import make_offload_key

from pykvcache.vllm.config import ConfigError, validate_extra_config
from pykvcache.vllm.host_config import publishing
from pykvcache.vllm.load_trace import open_trace
from pykvcache.vllm.logs import route_engine_logs
from pykvcache.vllm.scheduler.lookahead import WaitingRequest
from pykvcache.vllm.scheduler.step_timer import step_work
from pykvcache.vllm.scheduler.tenants import tenant_of_salt

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pykvcache.vllm.load_trace import LoadTrace
    from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager
    from pykvcache.vllm.worker.staging_worker import StagingWorker

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])
route_engine_logs()

SPEC_DEFAULTS = {"spec_name": "NvmeOffloadingSpec", "spec_module_path": "pykvcache.vllm"}


def _default_spec(vllm_config: VllmConfig) -> None:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return
    if kv.kv_connector_extra_config is None:
        kv.kv_connector_extra_config = {}
    for name, value in SPEC_DEFAULTS.items():
        kv.kv_connector_extra_config.setdefault(name, value)


def _kv_transfer_config(vllm_config: VllmConfig) -> KVTransferConfig:
    kv = vllm_config.kv_transfer_config
    assert kv is not None  # vLLM builds a connector only from its kv_transfer_config
    return kv


def chunk_size_problems(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> list[str]:
    """``block_size`` (tokens per chunk) against vLLM's KV block size. vLLM
    refuses one that is not a whole number of blocks while it builds the
    offloading config, before pykvcache's spec sees the settings, so its
    error would come alone and the others one start later. Several block
    sizes (hybrid models) or context parallelism: left to vLLM."""
    extra = _kv_transfer_config(vllm_config).kv_connector_extra_config or {}
    try:
        tokens = int(extra["block_size"])  # as vLLM reads it
    except (KeyError, TypeError, ValueError):
        return []
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    sizes = {getattr(g.kv_cache_spec, "block_size", None) for g in groups} or {vllm_config.cache_config.block_size}
    if len(sizes) != 1 or None in sizes or vllm_config.parallel_config.decode_context_parallel_size != 1:
        return []
    (size,) = sizes
    assert size is not None  # None in sizes returned above
    if tokens <= 0 or tokens % size == 0:
        return []
    lower, upper = tokens // size * size, (tokens // size + 1) * size
    return [
        f"block_size={tokens} (tokens per chunk) is not a multiple of vLLM's KV cache block size "
        f"({size} tokens, --block-size): give {upper}" + (f" or {lower}" if lower else "") + " (or blocks_per_chunk, in blocks)"
    ]


#: Longest a step that computes nothing sleeps on the reads its worker's
#: loads wait for (a request that arrives meanwhile waits at most this long).
IDLE_STEP_WAIT_S = 0.02


class PyKvCacheConnector(OffloadingConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        _default_spec(vllm_config)
        chunk_problems = chunk_size_problems(vllm_config, kv_cache_config)
        if chunk_problems:  # with every other problem of the settings, in one error
            validate_extra_config(_kv_transfer_config(vllm_config).kv_connector_extra_config, more=lambda _values: chunk_problems)
        # The spec fingerprints the model from the config, and its gate learns
        # the prefill side from the steps this connector reports.
        with publishing(vllm_config, reports_steps=True):
            # None only from a vLLM whose connectors are built without it (its base takes none then).
            super().__init__(vllm_config, role, cast("KVCacheConfig", kv_cache_config))
        self._manager: NvmeOffloadingManager | None = None
        self._groups: list[tuple[int, int, int]] = []
        self._load_reqs: dict[int, str] = {}  # worker: load job -> request
        # gate_trace: the load path's timestamps too (load_trace.py).
        self._trace = open_trace(vllm_config, "scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        self._loads_out: set[str] = set()  # scheduler: traced requests whose load is out
        if role != KVConnectorRole.SCHEDULER:
            return
        from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager

        manager = self.scheduler.manager
        if not isinstance(manager, NvmeOffloadingManager):
            raise ConfigError(
                "PyKvCacheConnector needs pykvcache's spec (spec_name NvmeOffloadingSpec, "
                f"spec_module_path pykvcache.vllm); got a {type(manager).__name__}"
            )
        self._manager = manager
        manager.disk.load_trace = self._trace
        self._enable_in_flight_hits(vllm_config, manager)
        policy = str(getattr(vllm_config.scheduler_config, "policy", "fcfs"))
        manager.preloader.queue.by_priority = policy.endswith("priority")
        # Full-attention groups only: their keys form a prefix vLLM loads from
        # the start; sliding-window groups load a window at the end.
        self._groups = [
            (g.group_idx, g.hashes_per_chunk, g.tokens_per_chunk)
            for g in self.scheduler.config.kv_group_configs
            if g.sliding_window_size_in_chunks is None
        ]

    @staticmethod
    def _enable_in_flight_hits(vllm_config: VllmConfig, manager: NvmeOffloadingManager) -> None:
        """A failed load must be recomputed, not fail the request: pykvcache is
        a cache, a chunk that cannot be read is one to recompute. vLLM's
        scheduler reads the policy right after building its connector (0.32,
        0.33), so setting it here takes effect."""
        kv = _kv_transfer_config(vllm_config)
        if kv.kv_load_failure_policy != "recompute":
            logger.info(
                "pykvcache: kv_load_failure_policy %r -> 'recompute' (a chunk whose read fails during a load is recomputed)",
                kv.kv_load_failure_policy,
            )
            kv.kv_load_failure_policy = "recompute"
        manager.enable_in_flight_hits()

    # -- worker side: loads the worker could not copy are failed receives ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._staging_worker()
        if worker is not None:
            worker.report_load_failures = True
            worker.trace = self._trace

    def _staging_worker(self) -> StagingWorker | None:
        from pykvcache.vllm.worker.staging_worker import StagingWorker

        worker = getattr(self.connector_worker, "worker", None)
        return worker if isinstance(worker, StagingWorker) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        for job_id, entry in getattr(meta, "load_jobs", {}).items():
            self._load_reqs[job_id] = entry.req_id
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._staging_worker()
        if worker is not None and getattr(self._connector_metadata, "pykvcache_idle_step", False):
            # vLLM runs a step that computes nothing back to back while a
            # request waits for its KV: without this the engine and the
            # worker spin on 2 cores the reads' completions need (decision 0065).
            worker.wait_for_reads(IDLE_STEP_WAIT_S)
        results = super().get_transfer_results(finished_req_ids)
        if worker is not None:
            for job_id in worker.take_failed_loads():
                req_id = self._load_reqs.get(job_id)
                if req_id is not None:
                    # Also in finished_recving (the job was reported finished):
                    # vLLM releases the request and recomputes its prefix.
                    results.failed_recving.add(req_id)
        done = results.finished_recving
        if done:
            for job_id in [j for j, r in self._load_reqs.items() if r in done]:
                del self._load_reqs[job_id]
        return results

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # The one hook vLLM calls with the connector's settings in the
        # front-end process before any model loads (while building the
        # VllmConfig, when CUDA graphs are on): reject bad settings there, once,
        # instead of in every worker after the model has loaded.
        validate_extra_config({**SPEC_DEFAULTS, **(extra_config or {})})
        return super().requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        _default_spec(vllm_config)
        prom = super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM creates a labelled series on its first observation; observing
        # every pykvcache counter at 0 now makes each series exist from
        # start-up (a dashboard sees 0, not "no data", before any request).
        from pykvcache.vllm.metrics import zero_counter_stats

        zeros = zero_counter_stats()
        for engine_idx in per_engine_labelvalues:
            prom.observe(zeros.data, engine_idx)
        return prom

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        if self._trace is not None:
            self._trace("arrival", req=request.request_id, tokens=request.num_tokens)
        # With an encryption key its chunks are sealed for its tenant (scheduler/tenants.py).
        tenant = tenant_of_salt(getattr(request, "cache_salt", None))
        if self._manager is not None and tenant:
            self._manager.request_tenant(request.request_id, tenant)
        if self._manager is None or not self._manager.preloader.enabled or not self._groups:
            return
        params: dict[str, Any] = request.kv_transfer_params or {}
        if request.skip_reading_prefix_cache or params.get("pykvcache_lookahead") is False:
            return
        hashes = request.block_hashes
        if not hashes:
            return
        key_lists = []
        max_chunks: int | None = None
        for group_idx, hashes_per_chunk, tokens_per_chunk in self._groups:
            # vLLM recomputes at least the last prompt token, so a chunk that
            # ends on it is never loaded: preloading it would be waste.
            loadable = (request.num_tokens - 1) // tokens_per_chunk
            keys = [make_offload_key(h, group_idx) for h in islice(hashes, hashes_per_chunk - 1, None, hashes_per_chunk)][:loadable]
            key_lists.append(keys)
            raw = params.get("max_load_tokens")
            if type(raw) is int and raw >= 0:
                max_chunks = raw // tokens_per_chunk
        if not any(key_lists):
            return
        self._manager.lookahead_add(
            WaitingRequest(
                req_id=request.request_id,
                key_lists=key_lists,
                priority=getattr(request, "priority", 0),
                arrival=getattr(request, "arrival_time", 0.0),
                max_chunks=max_chunks,
                device_cached_tokens=lambda: self._device_cached_tokens(request),
                tenant=tenant,
            )
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._trace is not None:
            self._trace("lookup", req=request.request_id, computed=num_computed_tokens, hit_tokens=result[0])
        return result

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self._trace is not None and num_external_tokens:
            self._trace("load_out", req=request.request_id, tokens=num_external_tokens)
            self._loads_out.add(request.request_id)

    def _trace_step(self, trace: LoadTrace, scheduler_output: SchedulerOutput) -> None:
        """A step built while a traced load is out (the last one prefills its request)."""
        if not self._loads_out:
            return
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        prefill = [r for r in self._loads_out if scheduled.get(r)]
        trace("step", tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0), prefill=prefill)
        self._loads_out.difference_update(prefill)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._trace is not None:
            self._trace_step(self._trace, scheduler_output)
        if self._manager is not None:
            # The gate learns the prefill cost from the engine's own steps:
            # this step's work now, its end at the next output or build.
            self._manager.step_scheduled(step_work(scheduler_output))
            # A preempted request that runs again is listed among the cached
            # requests, not the new ones: its lookahead holds end here.
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            for req_id in getattr(cached, "resumed_req_ids", None) or ():
                self._manager.on_request_resumed(req_id)
        meta = super().build_connector_meta(scheduler_output)
        # A step that computes nothing: its worker may sleep on the reads of
        # the loads it waits for instead of returning at once (decision 0065).
        # vLLM's metadata object carries pykvcache's flag to the worker (which reads it with getattr).
        meta.pykvcache_idle_step = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)  # type: ignore[attr-defined]
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._trace is not None:
            for req_id in getattr(connector_output, "finished_recving", None) or ():
                self._trace("received", req=req_id)
        if self._manager is not None:
            failed = getattr(connector_output, "failed_recving", None)
            if failed:
                self._manager.metrics.inc("failed_loads", len(failed))
                self._manager.loads_failed(failed)
            self._manager.step_finished()

    # A request finishes while its last step's output is processed: that step
    # has ended (vLLM reports no connector output for a step with nothing in it).
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished(request, block_ids)
        if self._manager is not None:
            self._manager.step_finished()
        return result

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished_all_groups(request, block_ids)
        if self._manager is not None:
            self._manager.step_finished()
        return result

    def _device_cached_tokens(self, request: Request) -> int:
        """Prompt tokens the device prefix cache already holds (not worth
        preloading); 0 when unknown."""
        kv_manager = getattr(self, "_kv_cache_manager", None)
        if kv_manager is None:
            return 0
        try:
            found = kv_manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
            return int(found[1])
        except Exception:  # noqa: BLE001 - an estimate; never fail a request over it
            logger.debug("device cache probe failed", exc_info=True)
            return 0
