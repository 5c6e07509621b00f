"""Open file descriptors of every process on this host, by what they point to
(how tests find staging memfds: they have no name in any filesystem)."""

from __future__ import annotations

import os


def fd_links(prefix: str) -> list[tuple[str, str, str]]:
    """``(pid, fd, target)`` of every open descriptor whose target starts with ``prefix``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.append((pid, fd, target))
    return found
