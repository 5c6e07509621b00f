"""Is a chunk on disk? One answer for the standalone manager and the tier.

The index answers first. A chunk another engine sharing the directories
published since is found by one ``lstat`` of its name (``BlockStore.probe``):
the index only learns it by a read or a refresh. A waiting request is looked
up every scheduler step, so a key found absent is probed again only after
``PROBE_INTERVAL_S``. After a read that served nothing the engine's verdict on
the file (``IoResult.miss_kind``, decision 0050) says what to remember: a key
whose file could not be read (``unavailable``: the read timed out, failed, or
met an open circuit breaker) counts as absent for ``PROBE_INTERVAL_S`` (reading
it again at once would wait on the same stalled directory, or fail the same
way, every step); a key whose file the engine keeps but does not serve
(``kept``: another writer's) for ``KEPT_RETRY_S``. Nothing here, nor in its
callers, deletes a chunk file: the engine removed a corrupt one itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pykvcache import BlockStore
    from pykvcache.vllm.metrics import ManagerMetrics

#: Chunks another engine publishes in shared directories become visible within this.
PROBE_INTERVAL_S = 1.0
#: A file the engine keeps but does not serve stays so until its writer or an
#: eviction replaces it: reading it sooner would only repeat a whole-chunk read.
KEPT_RETRY_S = 30.0
#: Keys remembered per map; cleared wholesale when full (bounded memory).
PROBE_MEMORY = 100_000


class DiskPresence:
    def __init__(self, metrics: ManagerMetrics) -> None:
        self._metrics = metrics
        self._absent: dict[bytes, float] = {}  # key -> next probe time
        self._unreadable: dict[bytes, float] = {}  # key -> when it may be read again

    def on_disk(self, store: BlockStore, key: bytes) -> bool:
        now = time.monotonic()
        if self._unreadable:
            if self._unreadable.get(key, 0.0) > now:
                return False
            self._unreadable.pop(key, None)
        if store.contains(key):
            return True
        if self._absent.get(key, 0.0) > now:
            return False
        if store.probe(key):
            self._absent.pop(key, None)
            self._metrics.inc("peer_chunks_found")
            return True
        _remember(self._absent, key, now + PROBE_INTERVAL_S)
        return False

    def read_failed(self, key: bytes, miss_kind: str | None) -> None:
        """A read of ``key`` served nothing; ``miss_kind`` is the engine's
        verdict on its file. ``absent`` and ``corrupt``: the engine's index
        dropped the key already (a probe finds a chunk published again)."""
        if miss_kind == "unavailable":
            self.unavailable(key)
        elif miss_kind == "kept":
            _remember(self._unreadable, key, time.monotonic() + KEPT_RETRY_S)

    def unavailable(self, key: bytes) -> None:
        """The chunk's file could not be read now: the chunk may well be there
        (nothing to drop), but do not read it again for a while."""
        _remember(self._unreadable, key, time.monotonic() + PROBE_INTERVAL_S)


def _remember(table: dict[bytes, float], key: bytes, until: float) -> None:
    if len(table) >= PROBE_MEMORY:
        table.clear()
    table[key] = until
