"""Is a chunk on disk? One answer for the standalone manager and the tier.

The index answers first. A chunk another engine sharing the directories
published since is found by one ``lstat`` of its name (``BlockStore.probe``):
the index only learns it by a read or a refresh. A waiting request is looked
up every scheduler step, so a key found absent is probed again only after
``PROBE_INTERVAL_S``, and a key whose directory was unavailable (a read timed
out, failed with a storage errno, or met an open circuit breaker) counts as
absent for as long: reading it again at once would wait on the same stalled
directory, or fail the same way, every step.
"""

from __future__ import annotations

import time

#: Chunks another engine publishes in shared directories become visible within this.
PROBE_INTERVAL_S = 1.0
#: Keys remembered per map; cleared wholesale when full (bounded memory).
PROBE_MEMORY = 100_000


class DiskPresence:
    def __init__(self, metrics) -> None:
        self._metrics = metrics
        self._absent: dict[bytes, float] = {}  # key -> next probe time
        self._unavailable: dict[bytes, float] = {}  # key -> when it may be read again

    def on_disk(self, store, key: bytes) -> bool:
        now = time.monotonic()
        if self._unavailable:
            if self._unavailable.get(key, 0.0) > now:
                return False
            self._unavailable.pop(key, None)
        if store.contains(key):
            return True
        if self._absent.get(key, 0.0) > now:
            return False
        if store.probe(key):
            self._absent.pop(key, None)
            self._metrics.inc("peer_chunks_found")
            return True
        _remember(self._absent, key, now)
        return False

    def unavailable(self, key: bytes) -> None:
        """The chunk's directory could not serve it now: the chunk may well be
        there (nothing to drop), but do not read it again for a while."""
        _remember(self._unavailable, key, time.monotonic())


def _remember(table: dict[bytes, float], key: bytes, now: float) -> None:
    if len(table) >= PROBE_MEMORY:
        table.clear()
    table[key] = now + PROBE_INTERVAL_S
