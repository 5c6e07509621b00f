"""Which chunk sits in which staging slot, who holds it, and what may be evicted.

The staging region is the only memory shared with the workers, so it doubles
as a small host-memory cache in front of the disk. An entry is evictable only
when it is READY and nobody holds a pin on it: in-flight NVMe reads (READING)
and worker copies into a slot (STORING) are never evicted, and every load,
pending disk write and owner (a waiting request, a preloader) pins what it
needs. Memory is bounded by the pool: there is never more than one entry per
slot.

This is the one place that knows who holds which slot. Owners are
``(kind, request id)`` pairs (:func:`owner`): ``lookup`` for a waiting
request between its lookups and its load, ``lookahead`` for a preload,
``load`` for a load in flight to the workers. The manager and the preloader
ask the cache (:meth:`held_by`, :meth:`keys_held`) instead of keeping their own
books; disk writes pin (:meth:`pin`), they have no request.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


LOOKUP = "lookup"
LOOKAHEAD = "lookahead"
LOAD = "load"


def owner(kind: str, req_id: Hashable) -> tuple[str, Hashable]:
    """The holder of a request's slots for one purpose."""
    return (kind, req_id)


def _kind_of(holder: Hashable) -> str | None:
    if isinstance(holder, tuple) and len(holder) == 2 and isinstance(holder[0], str):
        return holder[0]
    return None


class SlotAllocator(Protocol):
    """The part of :class:`pykvcache.StagingPool` the cache needs."""

    @property
    def num_slots(self) -> int: ...
    def try_acquire(self) -> int | None: ...
    def release(self, slot: int) -> None: ...
    @property
    def deferred_releases(self) -> int: ...


class EntryState(enum.Enum):
    STORING = "storing"  # a worker copies KV into the slot; not readable yet
    READING = "reading"  # an NVMe read fills the slot; not readable yet
    READY = "ready"  # verified bytes: a load may copy from the slot
    # The read failed while a load held the slot (a worker may be waiting on
    # its ready word): kept, never readable, until the last holder lets go.
    FAILED = "failed"


class Origin(enum.Enum):
    HOST = "host"  # stored from the KV cache in this process's lifetime
    DISK = "disk"  # read back from disk


@dataclass
class StagingEntry:
    key: bytes
    slot: int
    state: EntryState
    origin: Origin
    pins: int = 0
    owners: set[Hashable] = field(default_factory=set)
    # The generation of the slot's ready word armed by this entry's disk read
    # (0: none, the bytes came from a store): what a worker waits for.
    ready_gen: int = 0
    # Whose chunk it is (tenants.py): sealed and opened for it, served only to it.
    tenant: bytes = b""

    @property
    def evictable(self) -> bool:
        return self.state is EntryState.READY and self.pins == 0 and not self.owners


class StagingCache:
    def __init__(self, allocator: SlotAllocator) -> None:
        self._allocator = allocator
        self._entries: dict[bytes, StagingEntry] = {}
        # READY entries nobody holds, least recently used first.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._owned: dict[Hashable, set[bytes]] = {}
        # kind -> key -> how many owners of that kind hold it
        self._by_kind: dict[str, dict[bytes, int]] = {}
        # Slots the pool refused to take back (still exported or under I/O);
        # retried before every allocation instead of being lost.
        self._unreleased: list[int] = []
        self.evictions = 0

    # -- queries -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[StagingEntry]:
        return iter(list(self._entries.values()))

    def get(self, key: bytes) -> StagingEntry | None:
        return self._entries.get(key)

    @property
    def num_slots(self) -> int:
        return self._allocator.num_slots

    def allocatable(self) -> int:
        """Slots an insert could obtain now (free ones plus evictable entries)."""
        return self._free() + len(self._lru)

    def _free(self) -> int:
        """Slots the pool can hand out now: not held by an entry, not waiting
        to be released, not released into quarantine (a read abandoned past
        its deadline: free when the kernel lets go of it)."""
        self._retry_unreleased()
        return self.num_slots - len(self._entries) - len(self._unreleased) - self._allocator.deferred_releases

    def next_victim(self) -> bytes | None:
        """The key the next insert would evict, or None when a slot is free
        (or nothing is evictable)."""
        if self._free() > 0:
            return None
        return next(iter(self._lru), None)

    def pinned_slots(self) -> int:
        return len(self._entries) - len(self._lru)

    # -- allocation --------------------------------------------------------
    def insert(self, key: bytes, state: EntryState, origin: Origin, tenant: bytes = b"") -> StagingEntry | None:
        """Give ``key`` a slot, evicting the least recently used evictable entry
        if no slot is free. Returns None when every slot is held."""
        if key in self._entries:
            raise KeyError(f"chunk {key.hex()} is already staged")
        slot = self._take_slot()
        if slot is None:
            return None
        entry = StagingEntry(key=key, slot=slot, state=state, origin=origin, tenant=tenant)
        self._entries[key] = entry
        return entry

    def _take_slot(self) -> int | None:
        self._retry_unreleased()
        slot = self._allocator.try_acquire()
        if slot is not None:
            return slot
        if not self._lru:
            return None
        victim_key, _ = self._lru.popitem(last=False)
        victim = self._entries.pop(victim_key)
        self.evictions += 1
        # The victim is unpinned and READY: no reader, no I/O. Its slot goes
        # straight to the new entry instead of round-tripping through the pool.
        return victim.slot

    def remove(self, key: bytes) -> StagingEntry | None:
        """Drop ``key`` whatever its pins (the caller knows nothing uses the
        slot any more: failed read, failed store, reset)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._lru.pop(key, None)
        for holder in entry.owners:
            owned = self._owned.get(holder)
            if owned is not None:
                owned.discard(key)
                if not owned:
                    del self._owned[holder]
            self._count(holder, key, -1)
        self._release_slot(entry.slot)
        return entry

    def _release_slot(self, slot: int) -> None:
        try:
            self._allocator.release(slot)
        except Exception as exc:  # noqa: BLE001 - the pool says why; keep the slot
            logger.warning("staging slot %d not released yet (%s); retrying later", slot, exc)
            self._unreleased.append(slot)

    def _retry_unreleased(self) -> None:
        if not self._unreleased:
            return
        pending, self._unreleased = self._unreleased, []
        for slot in pending:
            self._release_slot(slot)

    def clear(self) -> None:
        for key in list(self._entries):
            self.remove(key)
        self._owned.clear()
        self._by_kind.clear()

    # -- state and pins ----------------------------------------------------
    def mark_ready(self, key: bytes, origin: Origin | None = None) -> None:
        entry = self._entries[key]
        entry.state = EntryState.READY
        if origin is not None:
            entry.origin = origin
        self._refresh(entry)

    def fail(self, key: bytes) -> None:
        """The read filling ``key`` failed. Dropped at once unless a load holds
        it; then FAILED until released, so its slot is never recycled while a
        worker may still wait on it."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if not self.is_held(key, LOAD):
            self.remove(key)
            return
        entry.state = EntryState.FAILED
        self._refresh(entry)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def pin(self, key: bytes) -> StagingEntry:
        entry = self._entries[key]
        entry.pins += 1
        self._lru.pop(key, None)
        return entry

    def unpin(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return  # removed meanwhile (reset or failed I/O)
        if entry.pins <= 0:
            raise RuntimeError(f"unbalanced unpin of chunk {key.hex()}")
        entry.pins -= 1
        self._refresh(entry)

    def hold(self, owner: Hashable, key: bytes) -> None:
        """Keep ``key`` staged for ``owner`` (e.g. a waiting request between its
        lookups and its load) until :meth:`release_owner`. Idempotent."""
        entry = self._entries[key]
        if owner in entry.owners:
            return
        entry.owners.add(owner)
        self._owned.setdefault(owner, set()).add(key)
        self._count(owner, key, +1)
        self._lru.pop(key, None)

    def release(self, owner: Hashable, key: bytes) -> None:
        """``owner`` no longer needs ``key`` (its other holds stay)."""
        owned = self._owned.get(owner)
        if owned is None or key not in owned:
            return
        owned.discard(key)
        if not owned:
            del self._owned[owner]
        entry = self._entries.get(key)
        if entry is not None:
            entry.owners.discard(owner)
            self._count(owner, key, -1)
            self._refresh(entry)

    def release_owner(self, owner: Hashable) -> None:
        for key in self._owned.pop(owner, ()):
            entry = self._entries.get(key)
            if entry is not None:
                entry.owners.discard(owner)
                self._count(owner, key, -1)
                self._refresh(entry)

    def held_by(self, owner: Hashable) -> frozenset[bytes]:
        return frozenset(self._owned.get(owner, ()))

    def keys_held(self, kind: str) -> frozenset[bytes]:
        """Keys held by at least one owner of ``kind`` (a shared prefix once)."""
        return frozenset(self._by_kind.get(kind, ()))

    def count_held(self, kind: str) -> int:
        return len(self._by_kind.get(kind, ()))

    def is_held(self, key: bytes, kind: str) -> bool:
        return key in self._by_kind.get(kind, ())

    def _count(self, holder: Hashable, key: bytes, delta: int) -> None:
        kind = _kind_of(holder)
        if kind is None:
            return
        keys = self._by_kind.setdefault(kind, {})
        n = keys.get(key, 0) + delta
        if n > 0:
            keys[key] = n
        else:
            keys.pop(key, None)

    def _refresh(self, entry: StagingEntry) -> None:
        if entry.state is EntryState.FAILED and entry.pins == 0 and not entry.owners:
            self.remove(entry.key)  # its last holder let go
            return
        if entry.evictable:
            self._lru[entry.key] = None
            self._lru.move_to_end(entry.key)
        else:
            self._lru.pop(entry.key, None)
