"""Store admission: skip writing chunks that can never pay off (docs/gate.md).

Two optional filters, both counted: **below break-even** (a request whose
storable prompt is shorter than the break-even would be recomputed anyway)
and **second sighting** (a chunk is written once a second request asked for
it, so one-off prompts cost no writes; sightings live in a bounded LRU).
Admission returns a *prefix* of the offered keys: a chunk after a skipped
one could never load (a lookup stops at the first miss).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

STORE_COUNTERS = {
    "store_skipped_below_break_even": "Chunks not written: their request is shorter than the break-even.",
    "store_skipped_first_sighting": "Chunks not written: seen by only one request so far.",
}


class StoreAdmission:
    def __init__(self, *, chunk_tokens: int, min_tokens: float = 0.0, second_sighting: bool = False, max_tracked: int = 1 << 18) -> None:
        if chunk_tokens <= 0 or max_tracked <= 0:
            raise ValueError("chunk_tokens and max_tracked must be > 0")
        self.chunk_tokens = chunk_tokens
        self.min_tokens = min_tokens
        self.second_sighting = second_sighting
        self.max_tracked = max_tracked
        # key -> id of the last request that saw it, and whether a second one did.
        self._seen: OrderedDict[Hashable, tuple[Hashable, bool]] = OrderedDict()
        self.totals = dict.fromkeys(STORE_COUNTERS, 0)
        self._pending: dict[str, int] = {}

    def sighted(self, req_id: Hashable, keys: Sequence[Hashable]) -> None:
        """A request asked for these chunk keys (call once per request, with its
        full key list, when the gate decides on it)."""
        if not self.second_sighting:
            return
        seen = self._seen
        for key in keys:
            prev = seen.get(key)
            if prev is None:
                seen[key] = (req_id, False)
            else:
                seen[key] = (req_id, prev[1] or prev[0] != req_id)
                seen.move_to_end(key)
        while len(seen) > self.max_tracked:
            seen.popitem(last=False)

    def admit(self, keys: Sequence[Hashable], *, request_tokens: int) -> int:
        """How many of ``keys`` (a request's chunks to store, in prompt order) to
        write; the rest are skipped for good. ``request_tokens`` is the
        request's storable length (prompt tokens rounded down to whole chunks)."""
        if not keys:
            return 0
        if request_tokens < self.min_tokens:
            self._inc("store_skipped_below_break_even", len(keys))
            return 0
        if not self.second_sighting:
            return len(keys)
        admitted = 0
        for key in keys:
            entry = self._seen.get(key)
            if entry is None or not entry[1]:
                break
            admitted += 1
        self._inc("store_skipped_first_sighting", len(keys) - admitted)
        return admitted

    def _inc(self, name: str, value: int) -> None:
        if value:
            self.totals[name] += value
            self._pending[name] = self._pending.get(name, 0) + value

    def take_counters(self) -> dict[str, int]:
        pending, self._pending = self._pending, {}
        return pending
