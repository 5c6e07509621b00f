"""The pykvcache engine through its public Python API: chunk stores and loads
with a fixed number of chunk operations in flight (the queue depth a caller
sees), timed and CPU-metered the same way as every other system here.

Each case writes fresh chunk files into an empty store sized to hold exactly
them, then (caches dropped when root) reads them all back; the device counters
tell whether the bytes really moved, and the last chunks read are compared byte
for byte with what was written. With ``overwrite`` it then writes as many new
chunks into the full store -- the steady state of a cache tier, every put
evicting one chunk -- once with evicted files recycled (the default) and once,
reopened with ``recycle_files=False``, with each victim unlinked and a fresh
file allocated. With ``preformat`` it finally empties the store, preformats it
(``pykvcache.preformat``: filler chunks up to the capacity) and writes the
chunks again: the first fill of a preformatted store ("write_preformatted").
"""

from __future__ import annotations

import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cold_cache import DiskCounter, drop_caches, settle
from .cpu_meter import CpuMeter
from .payload import digest, expected_digest, payload
from .results import PhaseResult

HEADER_BYTES = 4096


class BenchDataError(RuntimeError):
    """A benchmark phase returned errors or wrong data: its numbers are void."""


@dataclass(frozen=True)
class EngineCase:
    chunk_bytes: int
    queue_depth: int
    total_bytes: int
    # Extra BlockStore keyword arguments (segment_bytes, register_buffers, ...).
    store_kwargs: dict[str, Any] = field(default_factory=dict)
    # Also measure writes into the full store (phases "overwrite", "overwrite_no_recycle").
    overwrite: bool = False
    # Also measure the first fill of a preformatted store (phase "write_preformatted").
    preformat: bool = False
    # The phases' system name: "pykvcache", or "pykvcache_sealed" for a store with an
    # encryption key (store_kwargs' encryption_key_file; the storage part's --encrypt).
    system: str = "pykvcache"

    @property
    def chunks(self) -> int:
        return max(self.queue_depth, self.total_bytes // self.chunk_bytes)


def open_store(directory: Path, pool: Any, capacity_bytes: int, namespace: str, **store_kwargs: Any) -> Any:
    from pykvcache import BlockStore

    return BlockStore([str(directory)], pool, namespace=namespace, capacity_bytes=capacity_bytes, **store_kwargs)


def store_info(store: Any) -> dict[str, Any]:
    return {"backend": store.backend, "fixed_buffers": store.fixed_buffers, "direct_io": store.direct_io}


def pump(store: Any, op: str, keys: list[bytes], slots: list[int], length: int) -> tuple[int, list[str]]:
    """Keep ``len(slots)`` operations in flight until every key is done.

    Waits on the oldest operation (completions arrive nearly in order for
    same-sized chunks) and reuses its slot. Returns (ok count, error messages).
    """
    free = deque(slots)
    inflight: deque[Any] = deque()
    ok = 0
    errors: list[str] = []

    def retire() -> None:
        nonlocal ok
        h = inflight.popleft()
        r = h.wait()
        if r.ok:
            ok += 1
        else:
            errors.append(f"{op} {h.key!r}: {r.status} {r.message}")
        free.append(h.slot)

    for key in keys:
        if not free:
            retire()
        slot = free.popleft()
        inflight.append(store.put(key, slot, length) if op == "put" else store.get(key, slot))
    while inflight:
        retire()
    return ok, errors


def run_engine_case(
    case: EngineCase,
    directory: Path,
    *,
    disk: DiskCounter | None = None,
    cold: bool = True,
    cold_metadata: bool = False,
    repeat: int = 0,
    namespace: str = "pykvcache-bench",
) -> list[PhaseResult]:
    """Write ``case.chunks`` chunks, then read them back. Returns [write, read]."""
    from pykvcache import StagingPool

    directory.mkdir(parents=True, exist_ok=True)
    qd, chunk = case.queue_depth, case.chunk_bytes
    pool = StagingPool(chunk, qd)
    slots = [pool.acquire() for _ in range(qd)]
    for i, s in enumerate(slots):
        with pool.view(s) as v:
            v[:] = payload(i, chunk)
    keys = [f"bench-{chunk}-{qd}-{repeat}-{i}".encode() for i in range(case.chunks)]
    # Exactly the chunks of one pass: the first pass fills it, later passes evict.
    capacity = case.chunks * (HEADER_BYTES + -(-chunk // 4096) * 4096)
    store = open_store(directory, pool, capacity, namespace, **case.store_kwargs)
    params = {"queue_depth": qd, "repeat": repeat, "cold_metadata": cold_metadata, **case.store_kwargs}
    results: list[PhaseResult] = []
    try:
        info = store_info(store)
        for direction in ("write", "read"):
            if direction == "read":
                # Zero the slots so the final comparison proves the reads delivered the data.
                for s in slots:
                    with pool.view(s) as v:
                        v[:] = bytes(chunk)
                dropped = drop_caches(cold_metadata) if cold else False
            else:
                dropped = None
            settle()
            d0 = disk.sample() if disk else None
            with CpuMeter() as meter:
                ok, errors = pump(store, "put" if direction == "write" else "get", keys, slots, chunk)
            d1 = disk.sample() if disk else None
            cpu = meter.result
            assert cpu is not None
            delta = DiskCounter.delta(d0, d1)
            results.append(PhaseResult.measured(case.system, direction, chunk, ok, cpu, params, delta, dropped, errors, info))
            if errors:
                raise BenchDataError(f"pykvcache {direction} had {len(errors)} errors, first: {errors[0]}")
        # Each slot last received the final key written from it: its payload.
        for i, s in enumerate(slots):
            with pool.view(s) as v:
                if digest(v) != expected_digest(i, chunk):
                    raise BenchDataError(f"pykvcache read back wrong data into slot {s}")
        results[-1].info["stats"] = _plain(store.stats())
        if case.overwrite:
            results.append(_overwrite(store, keys, slots, chunk, params, info, disk, "overwrite", system=case.system))
            store.close()
            store = open_store(directory, pool, capacity, namespace, **{**case.store_kwargs, "recycle_files": False})
            results.append(_overwrite(store, keys, slots, chunk, params, info, disk, "overwrite_no_recycle", system=case.system))
        if case.preformat:
            store.close()
            for d in _namespace_dirs(store, directory):
                shutil.rmtree(d, ignore_errors=True)
            store = open_store(directory, pool, capacity, namespace, **case.store_kwargs)
            results.append(_write_preformatted(store, pool, keys, slots, chunk, params, info, disk, case.system))
    finally:
        store.close()
        for s in slots:
            pool.release(s)
        pool.close()
        for d in _namespace_dirs(store, directory):
            shutil.rmtree(d, ignore_errors=True)
        settle()
    return results


def _overwrite(
    store: Any,
    keys: list[bytes],
    slots: list[int],
    chunk: int,
    params: dict[str, Any],
    info: dict[str, Any],
    disk: DiskCounter | None,
    direction: str,
    suffix: bool = True,
    system: str = "pykvcache",
) -> PhaseResult:
    """One pass of new keys into the full store: each put evicts one chunk."""
    new_keys = [k + b"-" + direction.encode() for k in keys] if suffix else keys
    before = store.stats()
    settle()
    d0 = disk.sample() if disk else None
    with CpuMeter() as meter:
        ok, errors = pump(store, "put", new_keys, slots, chunk)
    d1 = disk.sample() if disk else None
    assert meter.result is not None
    after = store.stats()
    counts = {k: after[k] - before[k] for k in ("evictions", "recycled_files", "recycle_skipped")}
    phase = PhaseResult.measured(
        system, direction, chunk, ok, meter.result, params, DiskCounter.delta(d0, d1), None, errors, {**info, **counts}
    )
    if errors:
        raise BenchDataError(f"pykvcache {direction} had {len(errors)} errors, first: {errors[0]}")
    if counts["evictions"] < len(keys) - len(slots):
        raise BenchDataError(f"pykvcache {direction}: only {counts['evictions']} evictions for {len(keys)} puts")
    return phase


def _write_preformatted(
    store: Any,
    pool: Any,
    keys: list[bytes],
    slots: list[int],
    chunk: int,
    params: dict[str, Any],
    info: dict[str, Any],
    disk: DiskCounter | None,
    system: str = "pykvcache",
) -> PhaseResult:
    """Preformat the empty store (timed apart, in ``info``), then write every chunk once."""
    from pykvcache import preformat

    for s in slots:
        pool.release(s)
    try:
        report = preformat(store, pool, queue_depth=len(slots))
    finally:
        for _ in slots:
            pool.acquire()
    # preformat zeroed the slots: put the payloads back.
    for i, s in enumerate(slots):
        with pool.view(s) as v:
            v[:] = payload(i, chunk)
    if report.chunks != len(keys):
        raise BenchDataError(f"preformat wrote {report.chunks} fillers for a store of {len(keys)} chunks")
    phase = _overwrite(store, keys, slots, chunk, params, info, disk, "write_preformatted", suffix=False, system=system)
    phase.info.update(preformat_gbps=report.gb_per_s, preformat_s=report.seconds, fillers=report.chunks)
    return phase


def _namespace_dirs(store: Any, directory: Path) -> list[Path]:
    try:
        return [Path(p) for p in store.namespace_dir]
    except Exception:
        return [directory]


def _plain(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, list))}
