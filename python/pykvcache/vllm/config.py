"""Parsing and validation of ``kv_connector_extra_config`` for the pykvcache spec.

Each key is declared once, as a field of :class:`PykvcacheConfig`: its type
and default, and in its metadata (:func:`key`) how a value is checked (bounds
included) and the ``BlockStore`` keyword it becomes. Validation
(:func:`parse_extra_config`) and the store's keywords (:func:`store_keywords`)
are generated from those fields; the engine's defaults and limits come from
the engine (``_core.ENGINE_DEFAULTS``, ``_core.ENGINE_LIMITS``).

Everything is checked at once and reported in one :class:`ConfigError`, so a
user fixes the whole configuration in one go instead of meeting the problems
one crash at a time deep inside a worker process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NoReturn, TypeGuard

from pykvcache import _core
from pykvcache.vllm.config_checks import appendable_file_problems, filesystem_type, key_file_problems, staging_memory_problems

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

# Accepted choices, defaults and limits belong to the engine (rust/src/store/config.rs).
BACKENDS = _core.BACKENDS
DIRECT_IO_POLICIES = _core.DIRECT_IO_POLICIES
VERIFY_MODES = _core.VERIFY_MODES
ENGINE_DEFAULTS = _core.ENGINE_DEFAULTS

GIB = 1 << 30

#: Largest byte size accepted (the engine counts bytes in 64 bits).
MAX_BYTES = (1 << 63) - 1
#: Largest count accepted for integer keys (block_size, max_inflight_writes, ...).
MAX_COUNT = 1 << 31
#: The engine's io_uring queue depth limit.
MAX_QUEUE_DEPTH = _core.ENGINE_LIMITS["queue_depth"][1]
#: The most staging slots the engine's pool holds (slot numbers are 16-bit).
MAX_STAGING_SLOTS = _core.ENGINE_LIMITS["num_slots"][1]
#: Longest ``io_deadline_s`` accepted.
MAX_IO_DEADLINE_S = 3600.0

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
SHARED_FS_TYPES = frozenset(
    "nfs nfs4 cifs smb3 smbfs lustre gpfs ceph glusterfs 9p beegfs wekafs orangefs pvfs2 afs ocfs2 gfs2 cvfs panfs".split()
)


class ConfigError(ValueError):
    """The pykvcache section of ``kv_connector_extra_config`` is invalid.

    ``problems`` lists each problem found (the message lists them too), so
    that a caller adding its own checks still reports all in one error."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


class _Invalid(Exception):
    """A value a check refuses; ``problems`` are the messages to report."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems = list(problems)


#: A check: (key name, given value) -> the value to keep, or raises _Invalid.
Check = Callable[[str, Any], Any]


def _refuse(name: str, what: str, value: Any) -> NoReturn:
    raise _Invalid(f"{name} must be {what} (got {value!r})")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _size_value(value: Any) -> int | None:
    """The byte count a size means, or None when it is not one (negative,
    not finite, unparsable); may exceed MAX_BYTES."""
    if _is_int(value):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
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


# ---------------------------------------------------------------- checks


def size(*, zero: bool = False, zero_is_off: bool = False) -> Check:
    """Bytes: an int or a string with a suffix ("64GiB", "2TB"), at most
    MAX_BYTES; positive unless ``zero``. ``zero_is_off``: a value equal to 0
    turns the feature off (kept as 0)."""

    def check(name: str, value: Any) -> int:
        if zero_is_off and value == 0:
            return 0
        parsed = _size_value(value)
        if parsed is not None and parsed > MAX_BYTES:
            raise _Invalid(f"{name} must be at most {MAX_BYTES} bytes (got {value!r})")
        if parsed is not None and (parsed > 0 or zero):
            return parsed
        return _refuse(name, f"a {'' if zero else 'positive '}number of bytes or a string such as '64GiB'", value)

    return check


def count(low: int, high: float) -> Check:
    """An int in ``low..=high``."""
    what = f"a positive integer, at most {high}" if low == 1 else f"an integer in {low}..{high}"

    def check(name: str, value: Any) -> int:
        return value if _is_int(value) and low <= value <= high else _refuse(name, what, value)

    return check


def number(
    what: str, *, above: float | None = None, at_least: float | None = None, below: float = math.inf, at_most: float | None = None
) -> Check:
    """A finite int or float (not a bool) within the bounds given, as a float."""

    def check(name: str, value: Any) -> float:
        ok = (
            _is_number(value)
            and not math.isnan(value)
            and (above is None or value > above)
            and (at_least is None or value >= at_least)
            and (value <= at_most if at_most is not None else value < below)
        )
        return float(value) if ok else _refuse(name, what, value)

    return check


def flag(name: str, value: Any) -> bool:
    return value if isinstance(value, bool) else _refuse(name, "true or false", value)


def choice(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any) -> str:
        return value if isinstance(value, str) and value in choices else _refuse(name, f"one of {', '.join(choices)}", value)

    return check


def literal(word: str) -> Check:
    def check(name: str, value: Any) -> str:
        return value if isinstance(value, str) and value == word else _refuse(name, repr(word), value)

    return check


def either(what: str, *checks: Check) -> Check:
    """The first of ``checks`` that accepts the value; else one problem saying ``what``."""

    def check(name: str, value: Any) -> Any:
        for one in checks:
            try:
                return one(name, value)
            except _Invalid:
                pass
        return _refuse(name, what, value)

    return check


def text(*, empty: bool) -> Check:
    what = "a string" if empty else "a non-empty string"

    def check(name: str, value: Any) -> str:
        return value if isinstance(value, str) and (empty or value) else _refuse(name, what, value)

    return check


def label(name: str, value: Any) -> str:
    """A name for the model, as a hub id or a directory name is written
    ("llama-3-8b", "meta-llama/Llama-3-8B"): not a path to climb out of
    ("..", "/etc"), no control characters. It only labels the namespace (a
    digest names the directories), but a value that looks like a path is a
    mistake to report, not to file chunks under."""
    if not isinstance(value, str) or not value.strip():
        return _refuse(name, "a non-empty label such as 'llama-3-8b' or 'org/model'", value)
    parts = value.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in value or any(not c.isprintable() for c in value):
        return _refuse(
            name,
            "a label such as 'llama-3-8b' or 'org/model' (no '.' or '..' parts, no leading, "
            "trailing or double '/', no backslash or control characters)",
            value,
        )
    return value


def file_path(name: str, value: Any) -> str:
    # A missing or foreign profile is not an error: the gate warns and falls
    # back to a conservative default when the engine starts.
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        return _refuse(name, "a file path or null", value)
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def directories(name: str, value: Any) -> tuple[str, ...]:
    """Absolute paths, no two the same, none an existing non-directory."""
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        _refuse(name, "a non-empty list of directory paths", value)
    dirs: list[str] = []
    problems: list[str] = []
    for item in value:
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item).strip() or "\0" in os.fspath(item):
            problems.append(f"{name} entries must be non-empty paths (got {item!r})")
            continue
        path = os.path.abspath(os.path.expanduser(os.fspath(item)))
        if path in dirs:
            problems.append(f"{name} lists {path} twice")
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            problems.append(f"{name} entry {path} exists and is not a directory")
        dirs.append(path)
    if problems:
        raise _Invalid(*problems)
    return tuple(dirs)


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Key:
    """How a key's value is checked, and what the engine gets of it."""

    check: Check
    #: Why the key is needed, for a key without a default.
    required: str = ""
    #: ``null`` means "not given" (the default); otherwise it is checked.
    null_is_default: bool = False
    #: The ``BlockStore`` keyword it becomes (:func:`store_keywords`).
    store: str | None = None
    #: The keyword's value, when it is not the key's own value.
    to_store: Callable[[PykvcacheConfig], Any] | None = None


def key(default: Any = MISSING, **spec: Any) -> Any:
    """A field of :class:`PykvcacheConfig`: ``default`` (none: required) and
    the :class:`Key` in its metadata."""
    return field(default=default, metadata={"key": Key(**spec)})


@dataclass(frozen=True)
class PykvcacheConfig:
    """Validated settings of the vLLM integration (each key: docs/vllm.md)."""

    storage_dirs: tuple[str, ...] = key(check=directories, required="a list of directories on fast local disks")
    capacity_bytes: int = key(check=size(), required="disk bytes pykvcache may use in total", store="capacity_bytes")
    staging_bytes: int = key(1 * GIB, check=size())
    block_size: int | None = key(None, check=count(1, MAX_COUNT), null_is_default=True)
    blocks_per_chunk: int | None = key(None, check=count(1, MAX_COUNT), null_is_default=True)
    queue_depth: int = key(ENGINE_DEFAULTS["queue_depth"], check=count(1, MAX_QUEUE_DEPTH), null_is_default=True, store="queue_depth")
    backend: str = key(ENGINE_DEFAULTS["backend"], check=choice(BACKENDS), store="backend")
    direct_io: str = key(ENGINE_DEFAULTS["direct_io"], check=choice(DIRECT_IO_POLICIES), store="direct_io")
    # What a read checks: "full" (header + payload CRC-32C) or "header" (for
    # storage that checksums itself; docs/performance.md has the CPU it saves).
    verify: str = key(ENGINE_DEFAULTS["verify"], check=choice(VERIFY_MODES), store="verify")
    register_buffers: bool = key(True, check=flag, store="register_buffers")
    # Chunks in slots of segment files (decision 0086): "auto" = on network and FUSE filesystems that punch holes.
    segment_files: bool | str = key(
        ENGINE_DEFAULTS["segment_files"], check=either('"auto", true or false', literal("auto"), flag), store="segment_files"
    )
    max_inflight_writes: int = key(64, check=count(1, MAX_COUNT), null_is_default=True)
    offload_prompt_only: bool = key(False, check=flag)
    model_id: str | None = key(None, check=label, null_is_default=True)
    namespace_salt: str = key("", check=text(empty=True), null_is_default=True)
    # Content digest of the weights in the namespace (pykvcache.vllm.identity.model_identity).
    fingerprint_weights: bool = key(True, check=flag)
    wipe_on_reset: bool = key(True, check=flag)
    # Fill the free capacity with filler chunks (pykvcache.preformat): true = before
    # serving, "background" = while serving, yielding to serving I/O.
    preformat: bool | str = key(False, check=either('true, false or "background"', flag, literal("background")))
    # Start-up waits at most this long for it (vLLM gives an engine 600 s to
    # become ready); the next start continues where it stopped.
    preformat_max_s: float = key(300.0, check=number("a number of seconds > 0", above=0))
    # Break-even admission gate (docs/gate.md).
    gate_profile: str | None = key(None, check=file_path, null_is_default=True)
    gate: bool = key(True, check=flag)
    gate_margin: float = key(1.0, check=number("a number > 0", above=0))
    gate_online: bool = key(True, check=flag)
    # A JSON-lines trace of every gate decision, read and learnt period
    # (pykvcache.gate.trace; for diagnosing a run, not for production).
    gate_trace: str | None = key(None, check=file_path, null_is_default=True)
    # 0 = off, a token count, or "break_even".
    store_min_tokens: int | str = key(0, check=either('0 (off), a token count or "break_even"', count(0, math.inf), literal("break_even")))
    store_second_sighting: bool = key(False, check=flag)
    # Lookahead preloading (docs/lookahead.md); None = a share of staging_bytes.
    lookahead_bytes: int | None = key(None, check=size(zero_is_off=True), null_is_default=True)
    lookahead_requests: int = key(8, check=count(0, MAX_COUNT))
    lookup_hold_bytes: int | None = key(None, check=size(zero_is_off=True), null_is_default=True)
    # Free space kept on each storage filesystem for other writers; None = the
    # engine's default (5% of the filesystem, at most 16 GiB), 0 = none.
    min_free_bytes: int | None = key(None, check=size(zero=True), null_is_default=True, store="min_free_bytes")
    min_free_fraction: float | None = key(
        None, check=number("a number in [0, 1)", at_least=0, below=1), null_is_default=True, store="min_free_fraction"
    )
    # Seconds a disk read or write may take on a stalled directory before it
    # is a miss / a skipped put (decision 0031); None = the engine's default,
    # max(2 s, 4 * chunk bytes / 100 MB/s).
    io_deadline_s: float | None = key(
        None,
        check=number(f"a number of seconds in (0, {MAX_IO_DEADLINE_S:g}]", above=0, at_most=MAX_IO_DEADLINE_S),
        null_is_default=True,
        store="io_deadline",
    )
    # Chunks sealed with AES-256-GCM under a key file's key (decision 0083); the previous key
    # file's chunks are still read (a rotation), none written with it.
    encryption_key_file: str | None = key(None, check=file_path, null_is_default=True, store="encryption_key_file")
    encryption_previous_key_file: str | None = key(None, check=file_path, null_is_default=True, store="encryption_previous_key_file")
    # Accept a storage root owned by another user or world-writable.
    allow_insecure_root: bool = key(False, check=flag, store="allow_insecure_root")
    # Walk the storage directories this often so that chunks other nodes
    # wrote count against capacity_bytes (decisions 0036, 0053): seconds,
    # 0 = off, "auto" = SHARED_REFRESH_S on network/FUSE filesystems,
    # elsewhere the engine's "auto" (walks while another writer's lease is
    # live in the directory).
    refresh_interval_s: float | str = key(
        "auto",
        check=either('"auto", 0 (off) or a number of seconds', literal("auto"), number("", at_least=0)),
        store="refresh_interval_s",
        to_store=lambda config: refresh_interval(config),
    )

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def table(cls) -> dict[str, Key]:
        """Each key's :class:`Key`, in the order of the fields."""
        return {f.name: f.metadata["key"] for f in fields(cls)}


def _problems_error(problems: Sequence[str]) -> ConfigError:
    return ConfigError("invalid pykvcache settings in kv_connector_extra_config:\n  - " + "\n  - ".join(problems), problems)


def parse_extra_config(extra: Mapping[str, Any] | None) -> PykvcacheConfig:
    """Validate ``kv_connector_extra_config`` against the key table; raise one
    :class:`ConfigError` listing every problem found."""
    values, problems = _parse(extra)
    if problems:
        raise _problems_error(problems)
    return PykvcacheConfig(**values)


def _parse(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The valid values given (a key refused is left out) and every problem:
    each key's own, then the keys against each other."""
    extra = dict(extra or {})
    problems: list[str] = []
    known = PykvcacheConfig.keys() | VLLM_KEYS
    unknown = sorted(set(extra) - known)
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name, spec in PykvcacheConfig.table().items():
        if name not in extra or (spec.null_is_default and extra[name] is None):
            if spec.required:
                problems.append(f"{name} is required ({spec.required})")
            continue
        try:
            values[name] = spec.check(name, extra[name])
        except _Invalid as invalid:
            problems += invalid.problems
    if extra.get("block_size") is not None and extra.get("blocks_per_chunk") is not None:
        problems.append("give only one of block_size (tokens per chunk) and blocks_per_chunk")
    problems += _between_keys(values, extra)
    return values, problems


def _between_keys(values: dict[str, Any], extra: Mapping[str, Any]) -> list[str]:
    """What no key's own check sees: a share of staging larger than staging,
    a capacity that holds no chunk whatever its size. A key refused on its
    own is not compared (its problem is reported already)."""
    problems: list[str] = []
    staging = (
        values.get("staging_bytes", PykvcacheConfig.staging_bytes) if "staging_bytes" in values or "staging_bytes" not in extra else None
    )
    for name, what in (("lookahead_bytes", "preloads"), ("lookup_hold_bytes", "lookups of waiting requests")):
        share = values.get(name)
        if staging is not None and share and share > staging:
            problems.append(
                f"{name} ({share} bytes) is more than staging_bytes ({staging} bytes): the staging "
                f"that {what} may hold is a part of staging_bytes; lower it or raise staging_bytes"
            )
    smallest = _core.chunk_file_bytes(1)
    if "capacity_bytes" in values and values["capacity_bytes"] < smallest:
        problems.append(
            f"capacity_bytes ({values['capacity_bytes']} bytes) is smaller than the smallest chunk "
            f"file ({smallest} bytes: a header and one page of KV); nothing could be stored"
        )
    return problems


def store_keywords(config: PykvcacheConfig) -> dict[str, Any]:
    """The ``BlockStore`` keywords the configuration sets (each key's
    ``store``), besides the directories, the pool and the namespace."""
    return {
        spec.store: spec.to_store(config) if spec.to_store else getattr(config, name)
        for name, spec in PykvcacheConfig.table().items()
        if spec.store
    }


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
            continue  # not a directory: reported by directories()
        else:
            existing = os.path.dirname(real)
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
                problems.append(f"storage directory {shown} does not exist and cannot be created: {existing} is not a writable directory")
                continue
        if config.min_free_bytes:
            st = os.statvfs(existing)
            size = st.f_blocks * st.f_frsize
            if config.min_free_bytes >= size:
                problems.append(
                    f"min_free_bytes ({config.min_free_bytes}) is not smaller than the "
                    f"filesystem of {shown} ({size} bytes): nothing could be stored"
                )
    return problems


def validate_extra_config(extra: Mapping[str, Any] | None, *, more: Callable[[dict[str, Any]], list[str]] | None = None) -> PykvcacheConfig:
    """:func:`parse_extra_config` plus what the values mean on this host (the
    storage directories: :func:`storage_problems`; ``gate_trace``'s file;
    ``staging_bytes`` against the host's memory) and ``more(values)`` (a
    caller's checks, e.g. against the chunk size once vLLM has given it; it
    gets the values in effect, a key refused on its own left out): everything that can be checked before a
    model loads, all reported in one :class:`ConfigError`, also when some
    keys are refused on their own."""
    values, problems = _parse(extra)
    if "storage_dirs" in values:  # a placeholder capacity when it was refused: not used there
        problems += storage_problems(PykvcacheConfig(**{"capacity_bytes": 1, **values}))
    if values.get("encryption_key_file") or values.get("encryption_previous_key_file"):
        problems += key_file_problems(values.get("encryption_key_file"), values.get("encryption_previous_key_file"))
    if values.get("gate_trace"):
        problems += appendable_file_problems("gate_trace", values["gate_trace"])
    if "staging_bytes" in values:
        problems += staging_memory_problems(values["staging_bytes"])
    if more is not None:
        # The values in effect: defaults for the keys not given, none for a key refused.
        given = set(extra or {})
        problems += more(
            {**{f.name: f.default for f in fields(PykvcacheConfig) if f.default is not MISSING and f.name not in given}, **values}
        )
    if problems:
        raise _problems_error(problems)
    return PykvcacheConfig(**values)


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


def kv_transfer_config(storage_dirs: list[str], capacity_bytes: int | str, *, lookahead: bool = False, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that selects pykvcache's spec on vLLM's
    stock ``OffloadingConnector`` or, with ``lookahead``, on
    :class:`pykvcache.vllm.connector.PyKvCacheConnector` (pass it to
    ``vllm.LLM`` or as JSON to ``--kv-transfer-config``); ``extra`` adds further
    keys of the table in docs/vllm.md.

    Validated here (:func:`validate_extra_config`, raises :class:`ConfigError`):
    vLLM hands the connector's settings to pykvcache only after the model has
    loaded, so this is the earliest place a mistake can be reported."""
    connector = (
        {"kv_connector": "PyKvCacheConnector", "kv_connector_module_path": "pykvcache.vllm"}
        if lookahead
        else {"kv_connector": "OffloadingConnector"}
    )
    extra_config = {
        "spec_name": "NvmeOffloadingSpec",
        "spec_module_path": "pykvcache.vllm",
        "storage_dirs": list(storage_dirs),
        "capacity_bytes": capacity_bytes,
        **extra,
    }
    validate_extra_config(extra_config)
    return {**connector, "kv_role": "kv_both", "kv_connector_extra_config": extra_config}
