"""A request's chunk keys, as the manager's first lookup of it sees them.

vLLM's offloading connector looks keys up one at a time, but before the first
lookup of each step it records every chunk key of the request with its end
token in the ``ReqContext`` (``update_offload_keys``), so the manager can see
the whole list at the first key and gate once per request. The record is a
private field of vLLM (0.32/0.33); without it only the looked-up key is
returned and the gate decides on what it can see.
"""

from __future__ import annotations

from typing import Any


def request_keys_from(req_context: Any, first_key: bytes, chunk_tokens: int) -> tuple[list[bytes], int]:
    """``(keys, start_tokens)``: the request's chunk keys of ``first_key``'s KV
    group from ``first_key`` on, in prompt order, and the token where
    ``first_key``'s chunk starts."""
    positions: dict[bytes, int] | None = getattr(req_context, "_offload_key_positions", None)
    end = positions.get(first_key) if positions else None
    if positions is None or end is None:
        return [first_key], 0
    group = first_key[-4:]  # make_offload_key appends the group index
    by_end: dict[int, bytes] = {}
    for key, pos in positions.items():
        # Whole-chunk keys only (partial-tail boundary keys sit between), and
        # the first key recorded for an end position (the chunk key, recorded
        # before any boundary key).
        if pos >= end and pos % chunk_tokens == 0 and key[-4:] == group and pos not in by_end:
            by_end[pos] = key
    keys = []
    expected = end
    for pos in sorted(by_end):
        if pos != expected:  # a hole: the prefix cannot continue past it
            break
        keys.append(by_end[pos])
        expected += chunk_tokens
    return keys, end - chunk_tokens
