"""``--PART-set KEY=VALUE``: one option of a part's options dataclass, parsed by its type."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def apply_settings(opts: T, items: list[str], flag: str) -> T:
    """``opts`` with each ``KEY=VALUE`` of ``items`` set. A list option takes comma-separated
    values of its current elements' type (ints when it is empty), a bool ``1/true/yes`` or
    anything else for false; a typo names every key."""
    known = {f.name for f in fields(opts)}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        current = getattr(opts, key)
        parsed: Any
        if isinstance(current, list):
            kind = type(current[0]) if current else int
            parsed = [kind(v.strip()) for v in value.split(",") if v.strip()]
        elif isinstance(current, bool):
            parsed = value.lower() in ("1", "true", "yes")
        elif isinstance(current, int):
            parsed = int(float(value))
        elif isinstance(current, float):
            parsed = float(value)
        else:
            parsed = value
        opts = replace(opts, **{key: parsed})
    return opts
