"""The manager's KV events: what a KV-aware router learns of this node's disk (decision 0037).

A chunk is announced stored once its disk write completed (the staging copy
alone is not announced: the write may still fail), and removed once, when it
leaves the disk: whatever the engine's index loses (evicted for capacity,
found gone by a refresh because another node removed it, found corrupt) is
logged by the engine (``BlockStore.take_removed``: key hashes), a read that
found the chunk absent or corrupt says so at once, and a reset wipes every
chunk. Removals are announced only for chunks this node announced stored: a
chunk only read from another node's writes is that node's to announce.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent

from pykvcache._core import key_hash

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey

    from pykvcache._core import BlockStore

# Under "vllm." so the messages show up in vLLM's spawned processes, whose
# logging is configured for that namespace only.
logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])


class KvEvents:
    """Events (``OffloadingEvent``, medium ``STORAGE``) until vLLM takes them."""

    def __init__(self) -> None:
        self._events: list[OffloadingEvent] = []
        # The chunks this node announced as stored, by the hash the engine
        # reports removals with, so that each is announced removed once.
        self._announced: dict[int, bytes] = {}

    def stored(self, key: bytes) -> None:
        """The chunk's disk write completed."""
        self._announced[key_hash(bytes(key))] = bytes(key)
        self._append([key], removed=False)

    def left_disk(self, key: bytes) -> None:
        """A read found the chunk absent or corrupt (the engine decided its
        file's fate, decision 0050)."""
        if self._announced.pop(key_hash(bytes(key)), None) is not None:
            self._append([key], removed=True)

    def collect_removed(self, store: BlockStore) -> None:
        """The chunks the engine's index lost since the last call, among
        those this node announced as stored."""
        hashes, dropped = store.take_removed()
        if dropped:
            logger.warning("pykvcache: %d chunk removals were not announced as KV events (log full)", dropped)
        self._append([k for k in (self._announced.pop(h, None) for h in hashes) if k is not None], removed=True)

    def wiped(self, staged: Iterable[bytes]) -> None:
        """A reset wiped the disk and staging: every chunk staged or announced is gone."""
        removed = list(dict.fromkeys([*staged, *self._announced.values()]))
        self._announced.clear()
        self._append(removed, removed=True)

    def take(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def _append(self, keys: list[bytes], *, removed: bool) -> None:
        if keys:
            # The manager's chunk keys are vLLM's offload keys (OffloadKey is bytes under a NewType).
            self._events.append(
                OffloadingEvent(keys=cast("list[OffloadKey]", list(keys)), medium=Medium.STORAGE, removed=removed, locality=Locality.LOCAL)
            )
