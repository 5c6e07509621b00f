"""Parsing and validation of ``kv_connector_extra_config`` for the pykvcache spec.

Everything is checked at once and reported in one :class:`ConfigError`, so a
user fixes the whole configuration in one go instead of meeting the problems
one crash at a time deep inside a worker process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from pykvcache import _core

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

# Accepted choices and defaults belong to the engine (rust/src/store/config.rs).
BACKENDS = _core.BACKENDS
DIRECT_IO_POLICIES = _core.DIRECT_IO_POLICIES
VERIFY_MODES = _core.VERIFY_MODES

GIB = 1 << 30

#: Largest byte size accepted (the engine counts bytes in 64 bits).
MAX_BYTES = (1 << 63) - 1
#: Largest count accepted for integer keys (block_size, max_inflight_writes, ...).
MAX_COUNT = 1 << 31
#: The engine's io_uring queue depth limit.
MAX_QUEUE_DEPTH = 4096

#: Share of ``staging_bytes`` that preloads for waiting requests may hold, and
#: that lookups of waiting (not yet scheduled) requests may hold, by default.
#: The rest stays free for stores and for the request being scheduled.
LOOKAHEAD_SHARE = 0.5
LOOKUP_HOLD_SHARE = 0.5

#: ``refresh_interval_s: "auto"`` on a storage directory that other nodes may
#: share (a network or FUSE filesystem): a walk there costs ~0.4 s on the
#: GlusterFS test fixture, so every 10 s is ~4% of one core.
SHARED_REFRESH_S = 10.0
#: Filesystem types (/proc/self/mountinfo) that several hosts can mount.
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "9p",
    "beegfs", "wekafs", "orangefs", "pvfs2", "afs", "ocfs2", "gfs2", "cvfs", "panfs",
})


class ConfigError(ValueError):
    """The pykvcache section of ``kv_connector_extra_config`` is invalid.

    ``problems`` lists each problem found (the message lists them too), so
    that a caller adding its own checks still reports all in one error."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


@dataclass(frozen=True)
class PykvcacheConfig:
    """Validated settings of the vLLM integration (each key: docs/vllm.md)."""

    storage_dirs: tuple[str, ...]
    capacity_bytes: int
    staging_bytes: int = 1 * GIB
    block_size: int | None = None
    blocks_per_chunk: int | None = None
    queue_depth: int = _core.ENGINE_DEFAULTS["queue_depth"]
    backend: str = "auto"
    direct_io: str = "optional"
    # What a read checks: "full" (header + payload CRC-32C) or "header" (for
    # storage that checksums itself; docs/performance.md has the CPU it saves).
    verify: str = _core.ENGINE_DEFAULTS["verify"]
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
    # Free space kept on each storage filesystem for other writers; None = the
    # engine's default (5% of the filesystem, at most 16 GiB), 0 = none.
    min_free_bytes: int | None = None
    min_free_fraction: float | None = None
    # Seconds a disk read or write may take on a stalled directory before it
    # is a miss / a skipped put (decision 0031); None = the engine's default,
    # max(2 s, 4 * chunk bytes / 100 MB/s).
    io_deadline_s: float | None = None
    # Accept a storage root owned by another user or world-writable.
    allow_insecure_root: bool = False
    # Walk the storage directories this often so that chunks other nodes
    # wrote count against capacity_bytes (decisions 0036, 0053): seconds,
    # 0 = off, "auto" = SHARED_REFRESH_S on network/FUSE filesystems,
    # elsewhere the engine's "auto" (walks while another writer's lease is
    # live in the directory).
    refresh_interval_s: float | str = "auto"

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size_value(value: Any) -> int | None:
    """The byte count a size means, or None when it is not one (negative,
    not finite, unparsable); may exceed MAX_BYTES."""
    if _is_int(value):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            try:
                number = float(text[: -len(suffix)])
            except ValueError:
                return None
            # "infGiB", "nanGiB", "1e400GiB": not sizes (int() of them would
            # raise OverflowError/ValueError, not a ConfigError).
            if not math.isfinite(number) or number < 0:
                return None
            return int(number * mult)
    return int(text) if text.isdigit() else None


def parse_size(value: Any) -> int:
    """A byte size as the configuration keys accept it (``50331648``,
    ``"48MiB"``, ``"2TB"``); ValueError for anything else."""
    parsed = _size_value(value)
    if parsed is None:
        raise ValueError(f"expected a number of bytes or a size such as '64GiB', got {value!r}")
    return parsed


def _parse_size(name: str, value: Any, problems: list[str], *, allow_zero: bool = False) -> int | None:
    """Byte sizes: a positive int, or a string with a suffix ("64GiB", "2TB")."""
    parsed = _size_value(value)
    if parsed is not None and parsed > MAX_BYTES:
        problems.append(f"{name} must be at most {MAX_BYTES} bytes (got {value!r})")
        return None
    if parsed is not None and (parsed > 0 or allow_zero):
        return parsed
    problems.append(
        f"{name} must be a {'' if allow_zero else 'positive '}number of bytes or a string "
        f"such as '64GiB' (got {value!r})"
    )
    return None


def _parse_positive_int(name: str, value: Any, problems: list[str],
                        limit: int = MAX_COUNT) -> int | None:
    if not _is_int(value) or not 0 < value <= limit:
        problems.append(f"{name} must be a positive integer, at most {limit} (got {value!r})")
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
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item).strip() \
                or "\0" in os.fspath(item):
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
            limit = MAX_QUEUE_DEPTH if name == "queue_depth" else MAX_COUNT
            values[name] = _parse_positive_int(name, extra[name], problems, limit)
    if extra.get("min_free_bytes") is not None:
        values["min_free_bytes"] = _parse_size("min_free_bytes", extra["min_free_bytes"], problems,
                                               allow_zero=True)
    if extra.get("min_free_fraction") is not None:
        fraction = extra["min_free_fraction"]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 <= fraction < 1:
            problems.append(f"min_free_fraction must be a number in [0, 1) (got {fraction!r})")
        else:
            values["min_free_fraction"] = float(fraction)
    if extra.get("io_deadline_s") is not None:
        deadline = extra["io_deadline_s"]
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                or not 0 < deadline <= 3600:
            problems.append(f"io_deadline_s must be a number of seconds in (0, 3600] (got {deadline!r})")
        else:
            values["io_deadline_s"] = float(deadline)
    if "refresh_interval_s" in extra:
        value = extra["refresh_interval_s"]
        if value == "auto" or (not isinstance(value, bool) and isinstance(value, (int, float))
                               and 0 <= value < float("inf")):
            values["refresh_interval_s"] = value if value == "auto" else float(value)
        else:
            problems.append(f"refresh_interval_s must be \"auto\", 0 (off) or a number of seconds "
                            f"(got {value!r})")
    if extra.get("block_size") is not None and extra.get("blocks_per_chunk") is not None:
        problems.append("give only one of block_size (tokens per chunk) and blocks_per_chunk")

    if "preformat" in extra:
        if isinstance(extra["preformat"], bool) or extra["preformat"] == "background":
            values["preformat"] = extra["preformat"]
        else:
            problems.append(f"preformat must be true, false or \"background\" (got {extra['preformat']!r})")
    for name in ("register_buffers", "offload_prompt_only", "wipe_on_reset", "gate",
                 "gate_online", "store_second_sighting", "fingerprint_weights",
                 "allow_insecure_root"):
        if name in extra:
            values[name] = _parse_bool(name, extra[name], problems)
    if "backend" in extra:
        values["backend"] = _parse_choice("backend", extra["backend"], BACKENDS, problems)
    if "direct_io" in extra:
        values["direct_io"] = _parse_choice(
            "direct_io", extra["direct_io"], DIRECT_IO_POLICIES, problems
        )
    if "verify" in extra:
        values["verify"] = _parse_choice("verify", extra["verify"], VERIFY_MODES, problems)
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
            + "\n  - ".join(problems), problems
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
        if not _is_int(value) or not 0 <= value <= MAX_COUNT:
            problems.append(f"lookahead_requests must be an integer in 0..{MAX_COUNT} (got {value!r})")
        else:
            values["lookahead_requests"] = value


def storage_problems(config: PykvcacheConfig) -> list[str]:
    """What the engine would refuse about ``storage_dirs``, found without
    creating anything (so that it can run in vLLM's front-end process, before
    a model loads): each directory resolved through symlinks, usable (an
    existing directory or creatable under a writable one), writable, owned by
    this user and not world-writable (unless ``allow_insecure_root``), no two
    entries the same directory, and a free-space reserve smaller than its
    filesystem. The engine checks the same again when it opens the store."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    uid = os.geteuid()
    for entry in config.storage_dirs:
        real = os.path.realpath(entry)
        if real in seen:
            problems.append(f"storage_dirs entries {seen[real]} and {entry} are the same directory ({real})")
            continue
        seen[real] = entry
        shown = entry if real == entry else f"{entry} (-> {real})"
        if os.path.isdir(real):
            try:  # the engine's own check, so the two never disagree
                _core.check_storage_dir(real, allow_insecure_root=config.allow_insecure_root)
            except ValueError as exc:
                problems.append(str(exc) if real == entry else f"{exc} (storage_dirs entry {entry})")
            if not os.access(real, os.W_OK | os.X_OK):
                problems.append(f"storage directory {shown} is not writable by this process (uid {uid})")
            existing = real
        elif os.path.lexists(entry) and not os.path.exists(entry):
            problems.append(f"storage_dirs entry {entry} is a symlink to {real}, which does not exist")
            continue
        elif os.path.lexists(real):
            continue  # not a directory: reported by _parse_dirs
        else:
            existing = os.path.dirname(real)
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
                problems.append(f"storage directory {shown} does not exist and cannot be created: "
                                f"{existing} is not a writable directory")
                continue
        if config.min_free_bytes:
            st = os.statvfs(existing)
            size = st.f_blocks * st.f_frsize
            if config.min_free_bytes >= size:
                problems.append(f"min_free_bytes ({config.min_free_bytes}) is not smaller than the "
                                f"filesystem of {shown} ({size} bytes): nothing could be stored")
    return problems


def validate_extra_config(extra: Mapping[str, Any] | None) -> PykvcacheConfig:
    """:func:`parse_extra_config` plus :func:`storage_problems`: everything that
    can be checked before a model loads, reported in one :class:`ConfigError`."""
    config = parse_extra_config(extra)
    problems = storage_problems(config)
    if problems:
        raise ConfigError(
            "invalid pykvcache settings in kv_connector_extra_config:\n  - " + "\n  - ".join(problems), problems
        )
    return config


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point
    that is a prefix of it, from /proc/self/mountinfo); "" when unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount_point = left.split()[4].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, kind = mount_point, right.split()[0]
    except (OSError, IndexError):
        return ""
    return kind


def is_shared_filesystem(path: str) -> bool:
    kind = filesystem_type(path)
    return kind in SHARED_FS_TYPES or kind.startswith("fuse")


def refresh_interval(config: PykvcacheConfig) -> float | str | None:
    """The engine's ``refresh_interval_s``: seconds between walks of the
    storage directories, ``"auto"`` (walk while another writer's lease is live
    there: cheap to watch on a local disk) or None for none. On a network or
    FUSE filesystem "auto" is a timer: nodes that hold no lease (older
    versions) write there too, and a lease check is a round trip anyway."""
    value = config.refresh_interval_s
    if value == "auto":
        shared = any(is_shared_filesystem(d) for d in config.storage_dirs)
        return SHARED_REFRESH_S if shared else "auto"
    return float(value) or None


def lookahead_budget_bytes(config: PykvcacheConfig) -> int:
    if config.lookahead_bytes is not None:
        return min(config.lookahead_bytes, config.staging_bytes)
    return int(config.staging_bytes * LOOKAHEAD_SHARE)


def lookup_hold_budget_bytes(config: PykvcacheConfig) -> int:
    if config.lookup_hold_bytes is not None:
        return min(config.lookup_hold_bytes, config.staging_bytes)
    return int(config.staging_bytes * LOOKUP_HOLD_SHARE)


def kv_transfer_config(storage_dirs: list[str], capacity_bytes: int | str, *, lookahead: bool = False,
                       **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that selects pykvcache's spec on vLLM's
    stock ``OffloadingConnector`` or, with ``lookahead``, on
    :class:`pykvcache.vllm.connector.PyKvCacheConnector` (pass it to
    ``vllm.LLM`` or as JSON to ``--kv-transfer-config``); ``extra`` adds further
    keys of the table in docs/vllm.md.

    Validated here (:func:`validate_extra_config`, raises :class:`ConfigError`):
    vLLM hands the connector's settings to pykvcache only after the model has
    loaded, so this is the earliest place a mistake can be reported."""
    connector = ({"kv_connector": "PyKvCacheConnector", "kv_connector_module_path": "pykvcache.vllm"}
                 if lookahead else {"kv_connector": "OffloadingConnector"})
    config = {
        **connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "NvmeOffloadingSpec",
            "spec_module_path": "pykvcache.vllm",
            "storage_dirs": list(storage_dirs),
            "capacity_bytes": capacity_bytes,
            **extra,
        },
    }
    validate_extra_config(config["kv_connector_extra_config"])
    return config
