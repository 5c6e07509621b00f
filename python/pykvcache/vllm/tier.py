"""pykvcache as a secondary tier of vLLM's tiering framework.

``TieringOffloadingSpec`` keeps vLLM's CPU tier in front (GPU <-> CPU copies,
its eviction policy) and hands each secondary tier whole chunks of that CPU
tier: a store job copies chunks out of it, a promotion job fills allocated
chunks of it. Select this tier in ``kv_connector_extra_config``::

    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": ...,
    "secondary_tiers": [{"type": "PykvcacheTier", "module_path": "pykvcache.vllm.tier",
                         "storage_dirs": [...], "capacity_bytes": "200GiB"}]

What this tier brings over the ``fs`` tier: the engine's io_uring + O_DIRECT
I/O, a capacity with eviction, checksummed chunks (a corrupt or vanished chunk
fails only its own key of a promotion job, which the framework turns into a
miss), an index rebuilt at start (restart persistence), the namespace
fingerprint, and the break-even gate's per-request decision at the first
lookup the CPU tier missed. What only the standalone spec has: lookahead
preloading and lookup holds (the framework owns the waiting queue's view),
``wipe_on_reset`` (the framework never resets secondary tiers) and store
admission (the framework decides what cascades). Those keys are refused here
with that reason (docs/vllm.md, "pykvcache inside vLLM's tiering").

Every method runs in the scheduler process and returns without waiting: the
engine's I/O is asynchronous. By default (``cpu_tier_io: "copy"``, decision
0062) each chunk is copied between its CPU-tier row and one of the engine's
staging slots. With ``cpu_tier_io: "direct"`` the CPU tier's region is
registered with the engine once (decision 0062): each chunk's payload moves
between its row and the disk by the engine's own transfers (no copy, no
Python on the data path; the chunk header travels from an engine-owned
block). Where the region cannot be used (a row not a whole number of 4 KiB
pages or not page-aligned, a buffer the engine refuses) the tier says why
once and copies instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, ParamSpec, Protocol, TypeVar, cast

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from pykvcache import _core
from pykvcache.gate import ChunkState
from pykvcache.vllm.config import GIB, ConfigError, validate_extra_config
from pykvcache.vllm.host_config import find_vllm_config
from pykvcache.vllm.logs import route_engine_logs
from pykvcache.vllm.metrics import metric_definitions
from pykvcache.vllm.scheduler.disk_tier import (
    DiskTier,
    UsesDiskTier,
    chunk_namespace,
    model_identity_digest,
    open_store,
    size_staging,
    staging_size_problems,
)
from pykvcache.vllm.scheduler.gate_plan import build_gating
from pykvcache.vllm.scheduler.gating import GateHooks, GateInputs, Gating, RequestDropped

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

    from pykvcache._core import IoHandle
    from pykvcache.vllm.config import PykvcacheConfig


class _Exported(Protocol):
    """The buffer protocol (PEP 688's ``Buffer``): numpy's stubs declare it on arrays from Python 3.12 on."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


_P = ParamSpec("_P")
_R = TypeVar("_R")
_Tier = TypeVar("_Tier", bound="PykvcacheTier")

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])
route_engine_logs()

#: Keys of the standalone spec that mean nothing here, and why.
STANDALONE_ONLY = {
    "lookahead_bytes": "lookahead preloading needs PyKvCacheConnector and pykvcache's own spec",
    "lookahead_requests": "lookahead preloading needs PyKvCacheConnector and pykvcache's own spec",
    "lookup_hold_bytes": "the tiering framework owns the CPU tier that lookups fill",
    "wipe_on_reset": "vLLM's tiering framework never resets secondary tiers",
    "store_min_tokens": "the tiering framework decides which chunks cascade to a tier",
    "store_second_sighting": "the tiering framework decides which chunks cascade to a tier",
    "offload_prompt_only": "set it at the top level of kv_connector_extra_config (vLLM reads it there)",
    "block_size": "set it at the top level of kv_connector_extra_config (vLLM reads it there)",
    "blocks_per_chunk": "set it at the top level of kv_connector_extra_config (vLLM reads it there)",
    "max_inflight_writes": "staging_bytes bounds this tier's I/O in flight",
    "preformat": "not supported in tier mode yet",
    "preformat_max_s": "not supported in tier mode yet",
}
#: ``staging_bytes`` when not given: slots only bounce chunks between the CPU
#: tier and the disk, so far fewer are needed than in the standalone spec.
TIER_STAGING_BYTES = GIB // 4
#: The fewest staging slots that keep a read and a write in flight together
#: (and all the store gets when chunks go straight from and to the region).
MIN_TIER_SLOTS = 2
#: What the engine's transfers need of a region row (decision 0062): whole,
#: aligned blocks of the engine's I/O alignment.
PAGE = _core.IO_ALIGN
#: How long shutdown waits for transfers on the CPU tier's region to end
#: (only work stuck on a stalled directory takes any time).
UNREGISTER_WAIT_S = 10.0
#: Row-layout marker in the namespace: chunks are vLLM's CPU-tier chunk bytes,
#: not pykvcache's per-rank rows, so the two modes never read each other's files.
TIER_ROW_LAYOUT = "vllm-tiering-primary-chunk-v1"


#: ``cpu_tier_io``, the tier's own key: how chunks move between vLLM's CPU tier
#: and the disk (decision 0062). "copy" (default): through the engine's
#: staging slots, one memcpy each on the scheduler's thread; "direct": the
#: engine's transfers read and write the CPU tier's rows (no copy, less CPU
#: per GB, but on this project's virtio disk 0.30-0.62x the throughput: the
#: CPU tier's 4 KiB pages cost one device segment each where the staging
#: slots' huge pages do not). Unmeasured on NVMe, hence not the default.
CPU_TIER_IO = ("copy", "direct")


def _serialized(method: Callable[Concatenate[_Tier, _P], _R]) -> Callable[Concatenate[_Tier, _P], _R]:
    """One caller at a time: vLLM 0.33 calls a tier under its manager's lock but
    from more than one thread (the scheduler's and its tier-poll thread), and a
    direct user may call from several; the job queue, the staging slots and
    the operation table are one state. Re-entrant: shutdown drains through
    the same methods. Uncontended, a lock costs well under a microsecond per
    call, against milliseconds of disk I/O per chunk."""

    @functools.wraps(method)
    def locked(self: _Tier, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def tier_settings(options: dict[str, Any], chunk_bytes: int | None = None) -> PykvcacheConfig:
    """The tier's keys validated as the spec's are, with the keys that only the
    standalone spec has refused and, given the CPU tier's ``chunk_bytes``,
    what that chunk size makes of the sizes: all problems in one :class:`ConfigError`."""
    problems = [f"{k!r}: {STANDALONE_ONLY[k]} (standalone NvmeOffloadingSpec only)" for k in sorted(options) if k in STANDALONE_ONLY]
    if options.get("cpu_tier_io", CPU_TIER_IO[0]) not in CPU_TIER_IO:
        problems.append(f"'cpu_tier_io': must be one of {', '.join(map(repr, CPU_TIER_IO))} (got {options['cpu_tier_io']!r})")
    values = {k: v for k, v in options.items() if k not in STANDALONE_ONLY and k != "cpu_tier_io"}
    values.setdefault("staging_bytes", TIER_STAGING_BYTES)
    sizes = (
        None
        if chunk_bytes is None
        else (
            lambda v: staging_size_problems(
                v.get("staging_bytes"), v.get("capacity_bytes"), chunk_bytes, min_slots=MIN_TIER_SLOTS, clamp=True
            )
        )
    )
    try:
        config = validate_extra_config(values, more=sizes)
    except ConfigError as exc:
        # The rest is checked even when keys were refused: every problem in one error.
        problems += exc.problems
    if problems:
        raise ConfigError("invalid pykvcache tier settings (secondary_tiers entry):\n  - " + "\n  - ".join(problems), problems)
    return config


@dataclass(eq=False)
class _Job:
    job: TransferJob
    load: bool
    todo: deque[tuple[OffloadKey, int]]  # (key, chunk_id) not started yet
    running: int = 0
    ok: list[OffloadKey] = field(default_factory=list)
    failed: int = 0
    transfer_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    queued: bool = True  # still in the tier's job queue (finished by the queue)


class PykvcacheTier(UsesDiskTier, SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        options = {k: v for k, v in extra_config.items() if k not in ("type", "module_path", "backpressure", "locality")}
        tier_settings(options)  # a bad entry fails where vLLM builds its loggers, once
        return metric_definitions()

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: object = None,
        **options: Any,
    ) -> None:
        vllm_config = find_vllm_config()
        if getattr(vllm_config, "lora_config", None) is not None:
            # vLLM keys a LoRA request's blocks by the adapter's name and path, and a tier sees
            # keys, never requests: an adapter retrained under the same name would be served
            # the old adapter's KV. The standalone spec keys such chunks by the adapter's content.
            raise ValueError(
                "pykvcache: PykvcacheTier cannot tell LoRA adapters apart by their content; with "
                "LoRA enabled use pykvcache's own spec (PyKvCacheConnector or spec_name "
                "NvmeOffloadingSpec), which keys an adapter's chunks by its files' digest"
            )
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self._lock = threading.RLock()
        self._refusal_logged = False
        from pykvcache._core import StagingPool

        config = offloading_spec.config
        # The CPU tier as chunk rows (its stride is one chunk of every rank).
        primary = np.asarray(primary_kv_view).view(np.uint8)
        if primary.ndim != 2:
            primary = primary.reshape(primary.shape[0], -1)
        self._primary: np.ndarray | None = primary  # None once shutdown let it go
        self.chunk_bytes = int(primary.shape[1])
        self.settings = tier_settings(options, self.chunk_bytes)
        # Chunks in flight at once: what staging_bytes holds (it bounded the
        # slots that bounced chunks before the region path, and still does on
        # the fallback), within the engine's operation table.
        budget = size_staging(self.settings, self.chunk_bytes, min_slots=MIN_TIER_SLOTS, clamp=True).num_slots
        self._limit = min(budget, int(_core.ENGINE_DEFAULTS["max_inflight"]))
        self.cpu_tier_io = options.get("cpu_tier_io", CPU_TIER_IO[0])
        why_not = self._region_refusal() if self.cpu_tier_io == "direct" else None
        direct = self.cpu_tier_io == "direct" and why_not is None
        num_slots = MIN_TIER_SLOTS if direct else budget
        identity = model_identity_digest(vllm_config, config.model.name, self.settings)
        # The chunk is the CPU tier's (one chunk of every rank): its size, not
        # one worker's block, is what the bytes of a file depend on.
        self.namespace = chunk_namespace(
            config,
            self.settings,
            identity,
            lambda inputs: dataclasses.replace(inputs, bytes_per_block=self.chunk_bytes, row_layout_version=TIER_ROW_LAYOUT),
        )
        pool = StagingPool(self.chunk_bytes, num_slots)
        # The engine creates missing roots (0o700; see disk_tier.open_store).
        store = open_store(self.settings, pool, self.namespace, close_pool_on_failure=True)
        # The CPU tier's region, registered once: the engine holds its buffer
        # export until shutdown unregisters it (before the framework unmaps).
        self._region: int | None = None
        if direct:
            try:
                self._region = store.register_region(cast(_Exported, primary))
            except Exception as exc:  # noqa: BLE001 - the staging copy still works
                why_not = f"the engine refused the region: {exc}"
        if self._region is None:
            self._limit = min(self._limit, num_slots)
        if why_not is not None:
            logger.warning(
                'pykvcache tier: cpu_tier_io is "direct", but chunks are copied through staging '
                "slots (one memcpy each on the scheduler's thread): %s",
                why_not,
            )
        tokens_per_block = offloading_spec.tokens_per_block[0] if offloading_spec.tokens_per_block else 1
        self.chunk_tokens = offloading_spec.blocks_per_chunk * tokens_per_block

        # The store, its pool, the gate (it learns from the reads; decision
        # 0054: not from an outage's), metrics and presence: shared with the
        # standalone spec's manager.
        def gating(hooks: GateHooks) -> Gating:
            return build_gating(
                self.settings,
                hooks,
                model=config.model.name,
                dtype=str(config.model.dtype),
                chunk_bytes=self.chunk_bytes,
                chunk_tokens=self.chunk_tokens,
            )

        self.disk = DiskTier(
            store, pool, gating=gating, label="pykvcache tier", trouble="unusable chunks in the tier (each a miss)", log=logger
        )
        self._jobs: deque[_Job] = deque()  # jobs with chunks not started, in order
        # token -> (handle, job, key, chunk, staging slot or None)
        self._ops: dict[int, tuple[IoHandle, _Job, OffloadKey, int, int | None]] = {}
        # Tokens of region reads the I/O deadline abandoned: counted failed,
        # still in self._ops (their job unfinished) until the kernel let go of the row.
        self._unsettled: set[int] = set()
        self._next_token = 0
        self._unsettled_logged = False
        self._finished: list[JobResult] = []
        logger.info(
            "pykvcache tier: namespace %s on %s: capacity_bytes %d, %d chunk(s) found; "
            "chunks of %d bytes %s, at most %d in flight; backend %s, direct I/O %s",
            self.namespace,
            ", ".join(self.settings.storage_dirs),
            store.capacity_bytes,
            len(store),
            self.chunk_bytes,
            "via staging slots" if self._region is None else "straight from and to vLLM's CPU tier",
            self._limit,
            store.backend,
            store.direct_io,
        )

    def _region_refusal(self) -> str | None:
        """Why the CPU tier's rows cannot be the engine's transfer memory, or None."""
        if self.chunk_bytes % PAGE:
            return f"a chunk of {self.chunk_bytes} bytes is not a whole number of {PAGE}-byte pages"
        if not self._rows.flags.c_contiguous or not self._rows.flags.writeable:
            return "vLLM's CPU tier region is not one writable, contiguous buffer"
        if self._rows.ctypes.data % PAGE:
            return f"vLLM's CPU tier region is not {PAGE}-byte aligned"
        return None

    @property
    def _rows(self) -> np.ndarray:
        """The CPU tier's chunk rows."""
        assert self._primary is not None, "the tier was shut down"
        return self._primary

    # -- lookups ---------------------------------------------------------------
    def _on_disk(self, key: bytes) -> bool:
        return self.disk.on_disk(key)

    def _gate_inputs(self, keys: Sequence[bytes], req_id: Hashable) -> GateInputs:
        # Chunks the CPU tier holds never reach this tier's lookup; the
        # framework owns the waiting queue, so no request counts as waiting.
        queued = (len(self._ops) + sum(len(j.todo) for j in self._jobs)) * self.chunk_bytes
        return GateInputs([ChunkState.DISK if self._on_disk(k) else ChunkState.MISSING for k in keys], queued)

    @_serialized
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.gating.allows(key, req_context, self._gate_inputs):
            self.metrics.inc("gate_limited_lookups")
            return LookupResult.MISS
        return LookupResult.HIT if self._on_disk(key) else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @_serialized
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.gating.observe(RequestDropped(req_context.req_id))

    # -- jobs --------------------------------------------------------------------
    @_serialized
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    @_serialized
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job_metadata: TransferJob, load: bool) -> None:
        try:
            pairs = self._job_rows(job_metadata, load)
            if not load:
                pairs = [(key, row) for key, row in pairs if not self.store.contains(key)]
        except (TypeError, ValueError) as exc:
            self._refuse(job_metadata, load, str(exc))
            return
        self._jobs.append(_Job(job_metadata, load=load, todo=deque(pairs)))
        self._pump()

    def _job_rows(self, job_metadata: TransferJob, load: bool) -> list[tuple[OffloadKey, int]]:
        """The job's (key, CPU-tier row) pairs, or ValueError saying why there
        are none: one chunk id per key, each a row of the CPU tier (numpy would
        wrap -1 to the last row and a float to its floor), and no row read into
        twice by one promotion. The region transfers check their byte range in
        the engine too; the copy mode has only this."""
        keys = list(job_metadata.keys)
        chunks = np.asarray(job_metadata.chunk_ids)
        rows = self._rows.shape[0]
        if chunks.ndim != 1 or len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} key(s) but chunk ids of shape {chunks.shape}: one chunk id per key")
        if len(chunks) and chunks.dtype.kind not in "iu":
            raise ValueError(f"chunk ids must be integers (got dtype {chunks.dtype})")
        outside = [int(c) for c in chunks if not 0 <= c < rows]
        if outside:
            raise ValueError(f"chunk id(s) {outside[:4]} lie outside the CPU tier's {rows} chunks")
        if load and len(set(chunks.tolist())) != len(chunks):
            raise ValueError("a promotion names one CPU-tier chunk for two keys")
        if not all(isinstance(key, bytes) for key in keys):
            raise TypeError("keys must be bytes (vLLM's OffloadKey)")
        return list(zip(keys, (int(c) for c in chunks)))

    def _refuse(self, job_metadata: TransferJob, load: bool, why: str) -> None:
        """A job this tier cannot run fails alone: its result is a failure (for
        a promotion, no key read), nothing is queued, started or held."""
        (logger.warning if not self._refusal_logged else logger.debug)(
            "pykvcache tier: %s job %s refused, none of its chunks moved: %s%s",
            "promotion" if load else "store",
            job_metadata.job_id,
            why,
            "" if self._refusal_logged else " (further refusals are logged at debug level)",
        )
        self._refusal_logged = True
        job = _Job(job_metadata, load=load, todo=deque(), queued=False)
        job.failed = max(1, len(job_metadata.keys))
        self._maybe_finish(job)

    def _pump(self) -> None:
        """Collect finished I/O, then start queued chunks (in order) while fewer
        than the limit are in flight: a full tier leaves the rest queued here,
        one entry per chunk, until completions free room."""
        self._poll()
        while self._jobs:
            job = self._jobs[0]
            while job.todo:
                if len(self._ops) >= self._limit:
                    return
                slot = None
                if self._region is None:
                    slot = self.pool.try_acquire()
                    if slot is None:
                        return
                key, chunk = job.todo.popleft()
                self._start(job, key, chunk, slot)
            self._jobs.popleft()
            job.queued = False
            self._maybe_finish(job)

    def _start(self, job: _Job, key: OffloadKey, chunk: int, slot: int | None) -> None:
        try:
            if slot is None:
                # The engine moves the payload between the chunk's row and the disk.
                at = chunk * self.chunk_bytes
                if job.load:
                    handle = self.store.get_region(key, self._region, at, self.chunk_bytes)
                else:
                    handle = self.store.put_region(key, self._region, at, self.chunk_bytes)
            elif job.load:
                handle = self.store.get(key, slot)
            else:
                with self.pool.view(slot) as view:
                    np.frombuffer(view, dtype=np.uint8)[:] = self._rows[chunk]
                handle = self.store.put(key, slot, self.chunk_bytes)
        except Exception as exc:  # noqa: BLE001 - refused submission: this chunk fails
            self.disk.submit_refused("read" if job.load else "write", key, exc)
            if slot is not None:
                self.pool.release(slot)
            job.failed += 1
            return
        job.running += 1
        self._next_token += 1
        self._ops[self._next_token] = (handle, job, key, chunk, slot)

    def _poll(self, wait: bool = False) -> None:
        for token, (handle, job, key, chunk, slot) in list(self._ops.items()):
            if token in self._unsettled:
                # At shutdown (wait) nobody reuses the row, and unregistering
                # the region waits for the kernel.
                if wait or handle.settled():
                    self._unsettled.discard(token)
                    self._retire(token, job)
                continue
            if not wait and not handle.done():
                continue
            result = handle.wait()
            if job.load:
                # A failed read leaves the file to the engine (decision 0050).
                ok = self.disk.read_finished(key, result)
                if ok and slot is not None:
                    with self.pool.view(slot) as view:
                        self._rows[chunk] = np.frombuffer(view, dtype=np.uint8)[: self.chunk_bytes]
            else:
                ok = self.disk.write_finished(key, result)
            if slot is not None:
                self.pool.release(slot)
            if ok:
                job.ok.append(key)
                job.transfer_bytes += self.chunk_bytes
            else:
                job.failed += 1
            if job.load and slot is None and not wait and not handle.settled():
                # Abandoned at the I/O deadline with the read still in the
                # kernel: it may land bytes in the row when the directory
                # answers. Finishing the job would let vLLM reuse the row for
                # another chunk that those bytes then overwrite, so the job
                # waits for the read, as the fs tier's would (decision 0062).
                self._unsettled.add(token)
                if not self._unsettled_logged:
                    self._unsettled_logged = True
                    logger.warning(
                        "pykvcache tier: a read into vLLM's CPU tier was abandoned at the I/O deadline "
                        "while its directory stalls; its promotion job (a miss for that chunk) ends "
                        "when the read does, so the row is not reused under it"
                    )
                continue
            self._retire(token, job)

    def _retire(self, token: int, job: _Job) -> None:
        del self._ops[token]
        job.running -= 1
        if not job.queued:
            self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if job.todo or job.running:
            return
        success = job.failed == 0
        self._finished.append(
            JobResult(
                job_id=job.job.job_id,
                success=success,
                # A promotion that lost some chunks keeps the ones it read.
                successful_keys=None if success or not job.load else list(job.ok),
                transfer_time=time.monotonic() - job.started,
                transfer_bytes=job.transfer_bytes,
            )
        )

    @_serialized
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._pump()
        done, self._finished = self._finished, []
        return done

    @_serialized
    def has_pending_work(self) -> bool:
        # Results not yet collected (a refused job's) need a step too.
        return bool(self._ops or self._jobs or self._finished)

    @_serialized
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._pump()

    @_serialized
    def drain_jobs(self) -> None:
        while self._ops or self._jobs:
            self._pump()
            self._poll(wait=True)
        self._pump()

    @_serialized
    def get_stats(self) -> OffloadingConnectorStats | None:
        self._pump()
        # With the region, the gauges count chunks in flight against the limit.
        total = self.pool.num_slots if self._region is None else self._limit
        return self.disk.take_stats(staging_used=len(self._ops), staging_total=total)

    @_serialized
    def shutdown(self) -> None:
        """Finish what was submitted (stores persist), then close the store."""
        try:
            self.disk.shutdown(self.drain_jobs)
        finally:
            if self._region is not None:
                # Releases the buffer export (the store waits for any operation
                # still in flight on it: an abandoned one the kernel holds).
                region, self._region = self._region, None
                try:
                    self.store.unregister_region(region, timeout=UNREGISTER_WAIT_S)
                except Exception as exc:  # noqa: BLE001 - shutdown goes on; the export stays held
                    logger.warning(
                        "pykvcache tier: vLLM's CPU tier region is still in use by the disk (%s); "
                        "its buffer stays held until the process exits",
                        exc,
                    )
            self._primary = None  # lets the framework unmap its CPU tier
