"""Checks of the configuration against the host, beyond each key's own value.

:mod:`pykvcache.vllm.config` checks each key's type and bounds and the keys
against each other; what a value means on this host (is there that much
memory, can this file be written) is asked here, without creating or writing
anything, so that it can run in the caller's process before any engine starts
and again in the engine before anything is allocated. Each function returns
the problems it found (an empty list: none), to be reported with all others
in one error.
"""

from __future__ import annotations

import os
import stat

#: Filesystems whose files are kernel interfaces, not storage: a trace
#: appended to one of them (``/proc/sys/...``, ``/sys/...``) would be written
#: into a kernel setting, or fail on the first line.
PSEUDO_FS_TYPES = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "bpf",
        "pstore",
        "efivarfs",
        "fusectl",
        "mqueue",
        "hugetlbfs",
        "binfmt_misc",
        "autofs",
    }
)


def host_memory_bytes() -> int | None:
    """The most memory this process could ever get: the host's (MemTotal),
    lowered to its cgroup v2 limit (a container's ``--memory``); None when
    unknown. A bound, not what is free: it runs before the model loads, when
    what will be free is not known yet (the engine checks MemAvailable when it
    reserves the staging region)."""
    try:
        with open("/proc/meminfo") as f:
            line = next((l for l in f if l.startswith("MemTotal:")), "")
        total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            path = next((l.strip()[3:] for l in f if l.startswith("0::")), None)
        if path is not None:
            with open(f"/sys/fs/cgroup{path}/memory.max") as f:
                limit = f.read().strip()
            if limit.isdigit():  # "max": no limit
                total = min(total, int(limit))
    except OSError:
        pass
    return total


def staging_memory_problems(staging_bytes: int) -> list[str]:
    """``staging_bytes`` is reserved in full at start-up: more than the host
    (or the container) has can never be."""
    memory = host_memory_bytes()
    if memory is not None and staging_bytes > memory:
        return [
            f"staging_bytes ({staging_bytes} bytes, {staging_bytes / (1 << 30):.1f} GiB) is more than this "
            f"host's memory ({memory} bytes, {memory / (1 << 30):.1f} GiB, container limit included): "
            "it is reserved in full at start-up"
        ]
    return []


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


def appendable_file_problems(name: str, path: str) -> list[str]:
    """``path`` can be appended to by this process: an existing regular file,
    or a new one in an existing, writable directory, on a filesystem that
    stores files (not /proc, /sys, /dev)."""
    existing = path if os.path.lexists(path) else os.path.dirname(path)
    kind = filesystem_type(existing)
    if kind in PSEUDO_FS_TYPES:
        return [f"{name} {path} is on a {kind} filesystem (kernel interfaces, not files to write a trace to)"]
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return [f"{name} {path} cannot be used: {exc.strerror}"]
        if not stat.S_ISREG(mode):
            return [f"{name} {path} exists and is not a regular file"]
        if not os.access(path, os.W_OK):
            return [f"{name} {path} is not writable by this process (uid {os.geteuid()})"]
        return []
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        return [f"{name} {path} cannot be created: {parent} is not an existing directory"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"{name} {path} cannot be created: {parent} is not writable by this process (uid {os.geteuid()})"]
    return []


def key_file_problems(current: str | None, previous: str | None) -> list[str]:
    """The key files (``encryption_key_file``, ``encryption_previous_key_file``)
    read as the engine reads them (``_core.check_key_file``: a regular file of
    32 bytes that neither group nor others may read or write), each refusal in
    the engine's words, and the two against each other."""
    from pykvcache import _core

    problems: list[str] = []
    ids: dict[str, str] = {}
    for name, path in (("encryption_key_file", current), ("encryption_previous_key_file", previous)):
        if path is None:
            continue
        try:
            ids[name] = _core.check_key_file(path, what=name)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
    if previous is not None and current is None:
        problems.append(
            "encryption_previous_key_file is set without encryption_key_file: the previous key only reads "
            "chunks a store sealed before a rotation; give the new key as encryption_key_file"
        )
    elif len(ids) == 2 and len(set(ids.values())) == 1:
        problems.append("encryption_key_file and encryption_previous_key_file hold the same key: give the previous key, or leave it out")
    return problems
