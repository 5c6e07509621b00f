"""Parsing and validation of ``kv_connector_extra_config`` for the pykvcache spec.

Everything is checked at once and reported in one :class:`ConfigError`, so a
user fixes the whole configuration in one go instead of meeting the problems
one crash at a time deep inside a worker process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

#: Keys that vLLM itself reads from the same dict; accepted and left to vLLM
#: (``block_size``/``blocks_per_chunk`` are also validated here, because
#: vLLM's own message for a bad value is an assertion deep in start-up).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "self_describing_kv_events",
        "canonical_layout",
    }
)

BACKENDS = ("auto", "io_uring", "threads")
DIRECT_IO_POLICIES = ("required", "optional", "disabled")

GIB = 1 << 30

#: Share of ``staging_bytes`` that preloads for waiting requests may hold, and
#: that lookups of waiting (not yet scheduled) requests may hold, by default.
#: The rest stays free for stores and for the request being scheduled.
LOOKAHEAD_SHARE = 0.5
LOOKUP_HOLD_SHARE = 0.5


class ConfigError(ValueError):
    """The pykvcache section of ``kv_connector_extra_config`` is invalid."""


@dataclass(frozen=True)
class PykvcacheConfig:
    """Validated settings of the vLLM integration (each key: docs/vllm.md)."""

    storage_dirs: tuple[str, ...]
    capacity_bytes: int
    staging_bytes: int = 1 * GIB
    block_size: int | None = None
    blocks_per_chunk: int | None = None
    queue_depth: int = 32
    backend: str = "auto"
    direct_io: str = "optional"
    register_buffers: bool = True
    max_inflight_writes: int = 64
    offload_prompt_only: bool = False
    model_id: str | None = None
    namespace_salt: str = ""
    # Content digest of the weights in the namespace (pykvcache.vllm.model_identity).
    fingerprint_weights: bool = True
    wipe_on_reset: bool = True
    # Fill the free capacity with filler chunks (pykvcache.preformat): true = before
    # serving, "background" = while serving, yielding to serving I/O.
    preformat: bool | str = False
    # Start-up waits at most this long for it (vLLM gives an engine 600 s to
    # become ready); the next start continues where it stopped.
    preformat_max_s: float = 300.0
    # Break-even admission gate (docs/gate.md).
    gate_profile: str | None = None
    gate: bool = True
    gate_margin: float = 1.0
    gate_online: bool = True
    store_min_tokens: int | str = 0  # 0 = off, a token count, or "break_even"
    store_second_sighting: bool = False
    # Lookahead preloading (docs/lookahead.md); None = a share of staging_bytes.
    lookahead_bytes: int | None = None
    lookahead_requests: int = 8
    lookup_hold_bytes: int | None = None

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_size(name: str, value: Any, problems: list[str]) -> int | None:
    """Byte sizes: a positive int, or a string with a binary suffix ("64GiB")."""
    if _is_int(value):
        if value <= 0:
            problems.append(f"{name} must be > 0 (got {value})")
            return None
        return value
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
                 "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
        for suffix, mult in units.items():
            if text.upper().endswith(suffix):
                number = text[: -len(suffix)]
                try:
                    parsed = int(float(number) * mult)
                except ValueError:
                    break
                if parsed > 0:
                    return parsed
                break
        else:
            if text.isdigit() and int(text) > 0:
                return int(text)
    problems.append(
        f"{name} must be a positive number of bytes or a string such as '64GiB' (got {value!r})"
    )
    return None


def _parse_positive_int(name: str, value: Any, problems: list[str]) -> int | None:
    if not _is_int(value) or value <= 0:
        problems.append(f"{name} must be a positive integer (got {value!r})")
        return None
    return value


def _parse_bool(name: str, value: Any, problems: list[str]) -> bool | None:
    if not isinstance(value, bool):
        problems.append(f"{name} must be true or false (got {value!r})")
        return None
    return value


def _parse_choice(name: str, value: Any, choices: tuple[str, ...], problems: list[str]):
    if value not in choices:
        problems.append(f"{name} must be one of {', '.join(choices)} (got {value!r})")
        return None
    return value


def _parse_dirs(value: Any, problems: list[str]) -> tuple[str, ...] | None:
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        problems.append(
            "storage_dirs must be a non-empty list of directory paths "
            f"(got {value!r})"
        )
        return None
    dirs: list[str] = []
    for item in value:
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item).strip():
            problems.append(f"storage_dirs entries must be non-empty paths (got {item!r})")
            continue
        path = os.path.abspath(os.path.expanduser(os.fspath(item)))
        if path in dirs:
            problems.append(f"storage_dirs lists {path} twice")
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            problems.append(f"storage_dirs entry {path} exists and is not a directory")
        dirs.append(path)
    return tuple(dirs)


def parse_extra_config(extra: Mapping[str, Any] | None) -> PykvcacheConfig:
    """Validate ``kv_connector_extra_config``; raise one :class:`ConfigError` listing
    every problem found."""
    extra = dict(extra or {})
    problems: list[str] = []
    known = PykvcacheConfig.keys() | VLLM_KEYS
    unknown = sorted(set(extra) - known)
    if unknown:
        problems.append(
            f"unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(sorted(known))}"
        )

    values: dict[str, Any] = {}
    if "storage_dirs" not in extra:
        problems.append("storage_dirs is required (a list of directories on fast local disks)")
    else:
        values["storage_dirs"] = _parse_dirs(extra["storage_dirs"], problems)
    if "capacity_bytes" not in extra:
        problems.append("capacity_bytes is required (disk bytes pykvcache may use in total)")
    else:
        values["capacity_bytes"] = _parse_size("capacity_bytes", extra["capacity_bytes"], problems)
    if "staging_bytes" in extra:
        values["staging_bytes"] = _parse_size("staging_bytes", extra["staging_bytes"], problems)

    for name in ("block_size", "blocks_per_chunk", "queue_depth", "max_inflight_writes"):
        if extra.get(name) is not None:
            values[name] = _parse_positive_int(name, extra[name], problems)
    if extra.get("block_size") is not None and extra.get("blocks_per_chunk") is not None:
        problems.append("give only one of block_size (tokens per chunk) and blocks_per_chunk")

    if "preformat" in extra:
        if isinstance(extra["preformat"], bool) or extra["preformat"] == "background":
            values["preformat"] = extra["preformat"]
        else:
            problems.append(f"preformat must be true, false or \"background\" (got {extra['preformat']!r})")
    for name in ("register_buffers", "offload_prompt_only", "wipe_on_reset", "gate",
                 "gate_online", "store_second_sighting", "fingerprint_weights"):
        if name in extra:
            values[name] = _parse_bool(name, extra[name], problems)
    if "backend" in extra:
        values["backend"] = _parse_choice("backend", extra["backend"], BACKENDS, problems)
    if "direct_io" in extra:
        values["direct_io"] = _parse_choice(
            "direct_io", extra["direct_io"], DIRECT_IO_POLICIES, problems
        )
    for name in ("model_id", "namespace_salt"):
        if extra.get(name) is not None:
            if not isinstance(extra[name], str) or (name == "model_id" and not extra[name]):
                problems.append(f"{name} must be a non-empty string (got {extra[name]!r})")
            else:
                values[name] = extra[name]

    _parse_gate_and_lookahead(extra, values, problems)

    if problems:
        raise ConfigError(
            "invalid pykvcache settings in kv_connector_extra_config:\n  - "
            + "\n  - ".join(problems)
        )
    return PykvcacheConfig(**values)


def _parse_gate_and_lookahead(extra: Mapping[str, Any], values: dict[str, Any],
                              problems: list[str]) -> None:
    profile = extra.get("gate_profile")
    if profile is not None:
        if not isinstance(profile, (str, os.PathLike)) or not os.fspath(profile).strip():
            problems.append(f"gate_profile must be a file path or null (got {profile!r})")
        else:
            # A missing or foreign profile is not an error: the gate warns and
            # falls back to a conservative default when the engine starts.
            values["gate_profile"] = os.path.abspath(os.path.expanduser(os.fspath(profile)))
    if "preformat_max_s" in extra:
        limit = extra["preformat_max_s"]
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            problems.append(f"preformat_max_s must be a number of seconds > 0 (got {limit!r})")
        else:
            values["preformat_max_s"] = float(limit)
    if "gate_margin" in extra:
        margin = extra["gate_margin"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0 \
                or margin != margin or margin == float("inf"):
            problems.append(f"gate_margin must be a number > 0 (got {margin!r})")
        else:
            values["gate_margin"] = float(margin)
    if "store_min_tokens" in extra:
        value = extra["store_min_tokens"]
        if value == "break_even" or (_is_int(value) and value >= 0):
            values["store_min_tokens"] = value
        else:
            problems.append(
                f"store_min_tokens must be 0 (off), a token count or \"break_even\" (got {value!r})"
            )
    for name in ("lookahead_bytes", "lookup_hold_bytes"):
        if extra.get(name) is not None:
            if extra[name] == 0:  # 0 explicitly turns the feature off
                values[name] = 0
            else:
                values[name] = _parse_size(name, extra[name], problems)
    if "lookahead_requests" in extra:
        value = extra["lookahead_requests"]
        if not _is_int(value) or value < 0:
            problems.append(f"lookahead_requests must be an integer >= 0 (got {value!r})")
        else:
            values["lookahead_requests"] = value


def lookahead_budget_bytes(config: PykvcacheConfig) -> int:
    if config.lookahead_bytes is not None:
        return min(config.lookahead_bytes, config.staging_bytes)
    return int(config.staging_bytes * LOOKAHEAD_SHARE)


def lookup_hold_budget_bytes(config: PykvcacheConfig) -> int:
    if config.lookup_hold_bytes is not None:
        return min(config.lookup_hold_bytes, config.staging_bytes)
    return int(config.staging_bytes * LOOKUP_HOLD_SHARE)


def kv_transfer_config(storage_dirs: list[str], capacity_bytes: int | str, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that selects pykvcache's spec on vLLM's
    stock ``OffloadingConnector`` (pass it to ``vllm.LLM`` or as JSON to
    ``--kv-transfer-config``); ``extra`` adds further keys of the table in docs/vllm.md."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "NvmeOffloadingSpec",
            "spec_module_path": "pykvcache.vllm",
            "storage_dirs": list(storage_dirs),
            "capacity_bytes": capacity_bytes,
            **extra,
        },
    }
