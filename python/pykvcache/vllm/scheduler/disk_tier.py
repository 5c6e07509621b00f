"""One disk tier under both ways into vLLM (decision 0058).

The standalone spec (:mod:`~pykvcache.vllm.spec`, whose scheduler side is
:mod:`~pykvcache.vllm.scheduler.manager`) and the tier for vLLM's tiering framework
(:mod:`~pykvcache.vllm.tier`) put the same engine under two schedulers. What
the disk side of both is, is said here once:

* :func:`open_store`: the engine's ``BlockStore`` on the configured
  directories. The engine creates a missing storage root itself (mode 0o700,
  a concurrent mkdir on a shared filesystem retried: decision 0035); a root
  it cannot create is a :class:`~pykvcache.vllm.config.ConfigError` naming
  the ``storage_dirs`` entry;
* :func:`model_identity_digest` and :func:`chunk_namespace`: where the chunks
  live; :func:`size_staging`: how many staging slots ``staging_bytes`` gives;
* :class:`DiskTier`: what a finished read or write means for the metrics, the
  log of unusable chunks and the presence index (one answer for both:
  :mod:`~pykvcache.vllm.scheduler.disk_presence`), the engine's stats as gauges, the
  gate built with what only the store's owner knows (its breakers, where the
  learnt device model is kept: decision 0073), and shutdown.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pykvcache.gate import device_memory
from pykvcache.vllm.config import MAX_STAGING_SLOTS, ConfigError, PykvcacheConfig, store_keywords
from pykvcache.vllm.identity.model_identity import model_identity
from pykvcache.vllm.identity.namespace import NamespaceInputs, identity_digest, namespace_for
from pykvcache.vllm.logs import ChunkTroubleLog
from pykvcache.vllm.metrics import ManagerMetrics, failed_read_counter
from pykvcache.vllm.scheduler.disk_presence import DiskPresence
from pykvcache.vllm.scheduler.gating import (
    GateHooks,
    GateSnapshot,
    Gating,
    GatingFactory,
    ReadEnded,
    Tick,
    no_gating,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.config import OffloadingConfig

    from pykvcache._core import BlockStore, IoResult, StagingPool
    from pykvcache.vllm.load_trace import LoadTrace

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: Engine counters reported as gauges under another name (``disk_<name>`` mostly).
_ENGINE_GAUGES = (
    ("disk_filler_chunks", "filler_chunks"),
    ("disk_recycled_files", "recycled_files"),
    ("disk_recycle_skipped", "recycle_skipped"),
    ("disk_other_namespace_bytes", "other_namespace_bytes"),
    ("disk_other_writers", "other_writers"),
    ("disk_io_timeouts", "io_timeouts"),
    ("disk_breaker_opens", "breaker_opens"),
    ("disk_breaker_skipped_gets", "breaker_skipped_gets"),
    ("disk_breaker_skipped_puts", "breaker_skipped_puts"),
    ("disk_breaker_open_dirs", "breaker_open_dirs"),
    ("disk_stuck_ops", "stuck_ops"),
    ("disk_quarantined_slots", "quarantined_slots"),
)


# -- opening -------------------------------------------------------------------
def open_store(settings: PykvcacheConfig, pool: StagingPool, namespace: str, *, close_pool_on_failure: bool = False) -> BlockStore:
    """The engine's store on the configured directories, with ``pool`` as its
    staging. The engine creates a missing root (Python creates none first: it
    would give it the umask's mode, not 0o700); when it cannot, the error names
    the ``storage_dirs`` entry. With ``close_pool_on_failure`` the pool is
    closed when the store does not open (a caller that made it for the store)."""
    from pykvcache._core import BlockStore, StoreError

    s = settings
    try:
        return BlockStore(list(s.storage_dirs), pool, namespace=namespace, **store_keywords(s))
    except Exception as exc:
        if close_pool_on_failure:
            pool.close()
        # The engine creates the roots first, in order: one missing now is one it could not create.
        missing = [d for d in s.storage_dirs if not os.path.isdir(d)]
        if isinstance(exc, StoreError) and missing:
            raise ConfigError(f"storage_dirs entry {missing[0]} is unusable: {exc}") from exc
        raise


def model_identity_digest(vllm_config: VllmConfig | None, model_name: str, settings: PykvcacheConfig) -> str:
    """The model's identity (resolved config and, unless turned off, the
    weights' digest) as the namespace carries it."""
    return identity_digest(model_identity(vllm_config, model_name, fingerprint_weights=settings.fingerprint_weights))


def chunk_namespace(
    offloading_config: OffloadingConfig,
    settings: PykvcacheConfig,
    identity: str,
    adapt: Callable[[NamespaceInputs], NamespaceInputs] | None = None,
) -> str:
    """The namespace of this engine's chunks: vLLM's offloading config, the
    chunk format, ``model_id``, ``namespace_salt`` and the model's ``identity``;
    ``adapt`` changes the inputs where a mode lays the chunk bytes out otherwise."""
    from pykvcache._core import FORMAT_VERSION

    inputs = NamespaceInputs.from_offloading_config(
        offloading_config, format_version=FORMAT_VERSION, model_id=settings.model_id, salt=settings.namespace_salt, model_identity=identity
    )
    return namespace_for(inputs if adapt is None else adapt(inputs))


@dataclass(frozen=True)
class StagingSlots:
    num_slots: int
    #: One slot's bytes: a chunk file (header + payload).
    slot_footprint: int


def size_staging(settings: PykvcacheConfig, payload_bytes: int, *, min_slots: int, clamp: bool = False) -> StagingSlots:
    """The staging slots ``staging_bytes`` holds for chunks of ``payload_bytes``
    (:func:`staging_size_problems` says what is refused, all at once)."""
    from pykvcache._core import chunk_file_bytes

    problems = staging_size_problems(settings.staging_bytes, settings.capacity_bytes, payload_bytes, min_slots=min_slots, clamp=clamp)
    if problems:
        raise ConfigError("\n".join(problems), problems)
    footprint = chunk_file_bytes(payload_bytes)
    return StagingSlots(num_slots=min(settings.staging_bytes // footprint, MAX_STAGING_SLOTS), slot_footprint=footprint)


def staging_size_problems(
    staging: int | None, capacity: int | None, payload_bytes: int, *, min_slots: int, clamp: bool = False
) -> list[str]:
    """What the chunk size makes of ``staging_bytes`` and ``capacity_bytes``
    (None: not checked, e.g. refused on its own): at least ``min_slots``
    slots, at most :data:`MAX_STAGING_SLOTS` (more is refused, or with
    ``clamp`` cut to it), and a capacity of at least one chunk file (the
    engine would start and then refuse every write)."""
    from pykvcache._core import chunk_file_bytes

    problems = []
    footprint = chunk_file_bytes(payload_bytes)
    num_slots = staging // footprint if staging is not None else min_slots
    if num_slots < min_slots:
        problems.append(
            f"staging_bytes={staging} holds {num_slots} chunk(s) of {payload_bytes} bytes; give at least "
            f"{min_slots * footprint} bytes or use a smaller block_size"
        )
    if num_slots > MAX_STAGING_SLOTS and not clamp:
        most = MAX_STAGING_SLOTS * footprint
        problems.append(
            f"staging_bytes={staging} would hold {num_slots} staging slots of {footprint} bytes, more "
            f"than the {MAX_STAGING_SLOTS} the engine supports; give staging_bytes at most {most} "
            f"({most / (1 << 30):.1f} GiB) or a larger block_size"
        )
    if capacity is not None and capacity < footprint:
        problems.append(
            f"capacity_bytes={capacity} is smaller than one chunk file ({footprint} bytes: "
            f"{payload_bytes} bytes of KV per chunk plus its header); give at least {footprint} bytes "
            "(many chunks' worth to be useful) or use a smaller block_size"
        )
    return problems


# -- serving -------------------------------------------------------------------
class DiskTier:
    """The disk side of a scheduler: the store, its staging pool, the gate
    that learns from its reads, the metrics and the presence index. Its owner
    (the manager or the tier) moves the bytes and keeps its own books of what
    is in flight; this says what a finished read or write means.

    ``gating`` builds the gate (:class:`~pykvcache.vllm.scheduler.gating.GateHooks`
    from this store, and ``sampler``, which reads an exploration's sample in
    the background); ``label`` starts its log lines (``"pykvcache"``,
    ``"pykvcache tier"``); ``trouble`` names its log of unusable chunks;
    ``on_learnt`` is called after the gate learnt the device from a load."""

    def __init__(
        self,
        store: BlockStore,
        pool: StagingPool,
        *,
        gating: GatingFactory = no_gating,
        sampler: Callable[[Sequence[bytes]], Sequence[bytes]] | None = None,
        label: str = "pykvcache",
        trouble: str = "unusable chunks (each treated as a miss)",
        log: logging.Logger = logger,
        on_learnt: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.metrics = ManagerMetrics()
        self.presence = DiskPresence(self.metrics)
        self.closed = False
        self.load_trace: LoadTrace | None = None  # gate_trace: the load path's timestamps (load_trace.py)
        self._label = label
        self._log = log
        self._on_learnt = on_learnt
        self._unusable = ChunkTroubleLog(log, trouble)
        # (status, errno) of write failures logged so far: each kind is logged
        # once at WARNING (a full disk would otherwise log every chunk).
        self._write_failures_logged: set[tuple[str, int | None]] = set()
        # The gate must not learn the device from loads timed during a storage
        # outage, and restarts its exploration after one (decision 0054): it
        # follows the breakers (a lambda: the manager's reset_cache replaces
        # the store). A restart starts from what the last server on this
        # namespace learnt of the device, not from the prior (decision 0073).
        self.gating: Gating = gating(
            GateHooks(
                breakers=lambda: self.store.breaker_health(),
                io_deadline_s=store.stats()["io_deadline_s"],
                device_file=Path(store.namespace_dir[0]) / device_memory.FILE_NAME,
                sampler=sampler,
                log=log,
                label=label,
            )
        )

    def on_disk(self, key: bytes) -> bool:
        """In the index, or published since by another engine sharing the
        directories (:class:`~pykvcache.vllm.scheduler.disk_presence.DiskPresence`)."""
        return self.presence.on_disk(self.store, key)

    def submit_refused(self, op: str, key: bytes, exc: Exception) -> None:
        """The engine refused to start the ``op`` ("read" or "write") of ``key``."""
        self._log.warning("%s: %s of chunk %s not submitted: %s", self._label, op, key.hex(), exc)
        self.metrics.inc("read_errors" if op == "read" else "write_errors")

    def read_finished(self, key: bytes, result: IoResult, started_at: float | None = None) -> bool:
        """Counts a finished read (``IoResult``) and teaches the gate; True
        when it served the chunk. After a read that served nothing the engine
        alone decided the file's fate (decision 0050): it removed a corrupt
        one and keeps the rest, also a chunk another writer made or one a
        stalled directory could not read. What is left here is not to read
        it again at once (it would end the same way every step)."""
        ok = result.status == "ok"
        if self.load_trace is not None and started_at is not None:
            self.load_trace(
                "read",
                key=bytes(key)[:6].hex(),
                submitted=round(started_at, 6),
                ended=round(started_at + (result.latency_s or 0.0), 6),
                ok=ok,
                mb=round(int(result.length or 0) / 1e6, 3),
            )
        # Submitted at ``started_at`` (monotonic s): the device's busy periods,
        # preloads included (decision 0079); the plans timing this read.
        observed = self.gating.observe(
            ReadEnded(
                key,
                ok,
                result.latency_s or 0.0,
                int(result.length or 0) if ok else 0,
                started_at=started_at,
                timed_out=not ok and result.errno == errno.ETIMEDOUT,
            )
        )
        self.metrics.inc("gate_load_observations", observed)
        if observed and self._on_learnt is not None:
            self._on_learnt()
        if ok:
            self._count_io("read", result)
            return True
        self.metrics.inc(failed_read_counter(result.status, result.miss_kind))
        if result.status != "miss":
            self._unusable.report(key, result.status, result.message)
        self.presence.read_failed(key, result.miss_kind)
        return False

    def write_finished(self, key: bytes, result: IoResult) -> bool:
        """Counts a finished write; True when the chunk is on disk. Each kind
        of failure is logged once as a warning, then at debug level."""
        if result.status == "ok":
            self._count_io("write", result)
            return True
        self.metrics.inc("write_errors")
        kind = (result.status, result.errno)
        first = kind not in self._write_failures_logged
        self._write_failures_logged.add(kind)
        self._log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: write of chunk %s failed (%s: %s)%s",
            self._label,
            key.hex(),
            result.status,
            result.message,
            "; further failures like it are counted in write_errors" if first else "",
        )
        return False

    def _count_io(self, op: str, result: IoResult) -> None:
        self.metrics.inc(f"disk_{op}s")
        self.metrics.inc(f"disk_{op}_bytes", result.length)
        self.metrics.observe(f"disk_{op}_latency_seconds", result.latency_s)

    def gate_snapshot(self) -> GateSnapshot:
        """The gate's snapshot; its counters and gauges go into the metrics,
        whoever takes it (each snapshot takes the counters since the last)."""
        snap = self.gating.snapshot()
        for name, value in snap.counters.items():
            self.metrics.inc(name, value)
        for name, value in snap.gauges.items():
            self.metrics.set_gauge(name, value)
        return snap

    def take_stats(self, *, staging_used: int, staging_total: int) -> OffloadingConnectorStats | None:
        """The step's report: the gate's counters and gauges, staging use and
        the engine's stats as gauges (added to what the owner set)."""
        self.gating.observe(Tick())
        self.gate_snapshot()
        self.metrics.set_gauge("staging_slots_used", staging_used)
        self.metrics.set_gauge("staging_slots_total", staging_total)
        store = self.store
        self.metrics.set_gauge("disk_used_bytes", store.used_bytes)
        self.metrics.set_gauge("disk_chunks", len(store))
        self.metrics.set_gauge("disk_capacity_bytes", store.capacity_bytes)
        stats: Mapping[str, Any] = store.stats()  # every key of _ENGINE_GAUGES is a count
        for gauge, key in _ENGINE_GAUGES:
            self.metrics.set_gauge(gauge, stats[key])
        return self.metrics.take_stats()

    def shutdown(self, drain: Callable[[], None]) -> None:
        """Once: ``drain`` (finish what was submitted: stores persist), then
        close the store and unmap the staging region."""
        if self.closed:
            return
        self.closed = True
        try:
            drain()
        finally:
            self.gating.close()  # saves the learnt device model
            self._unusable.flush()
            self.store.close()
            try:
                self.pool.close()
            except Exception:  # noqa: BLE001 - shutting down anyway; say what failed
                self._log.exception("%s: could not unmap the staging region", self._label)


def _of_disk(name: str, doc: str, *, settable: bool = False) -> property:
    def set_(self: UsesDiskTier, value: object) -> None:
        setattr(self.disk, name, value)

    return property(lambda self: getattr(self.disk, name), set_ if settable else None, doc=doc)


class UsesDiskTier:
    """The names a scheduler on a :class:`DiskTier` (``self.disk``) answers to."""

    disk: DiskTier
    store = _of_disk("store", "The engine's store (settable: the manager's wipe reopens it, tools wrap it).", settable=True)
    gating = _of_disk("gating", "The gate (gating.Gating; settable).", settable=True)
    pool = _of_disk("pool", "The staging pool the engine reads into and writes from.")
    metrics = _of_disk("metrics", "The counters, gauges and histograms reported to vLLM.")
