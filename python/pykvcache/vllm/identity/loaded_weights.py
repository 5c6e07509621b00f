"""Whether the files digested are the files vLLM loaded.

vLLM reads the weights before it builds anything of pykvcache's (the
scheduler's connector and the workers' are both constructed after the model
has loaded, in vLLM 0.32 and 0.33), so the digest is necessarily taken after
the load. A file replaced in between (a weight update to the same path during
a restart) would give the KV computed with the old weights the new weights'
namespace. Nothing of ours runs early enough to look at the files first, but
the kernel keeps the answer: every change to a file sets its ``ctime`` (a
write, a truncate, a ``utime`` that puts the mtime back; only the kernel sets
it), and adding, removing or renaming an entry sets the directory's
``mtime``. So if, after the digest, no digested file, no directory holding
one and no link leading to one changed since a moment that precedes vLLM's
first read, the bytes vLLM loaded are the bytes digested.

That moment is when the engine's ``VllmConfig`` was made: vLLM stamps it
(``instance_id``, nanoseconds of wall time, set in ``__post_init__``) before
any engine process starts, and the weights are read after. Where the stamp
is not a time (another vLLM), this process's start is used, which is earlier
still: more starts are refused, none is trusted wrongly.

Limits: timestamps come from the clock of whoever writes the file; on a
network filesystem whose server clock runs behind this node's, a change
during the load can look older than it is (the digest cache has the same
limit, decision 0052). A directory above the model's directory swapped for
another (``mv v2 current``) changes only that parent's entries: the model
directory's own ``ctime`` shows it on Linux's local filesystems (a rename
sets the renamed inode's ``ctime``), not on every filesystem.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Margin below the engine's start for filesystems that stamp whole seconds
#: (a change just after the start can carry the second before it).
COARSE_MARGIN_NS = 2_000_000_000
#: Margin for nanosecond timestamps: the kernel stamps files from a clock that
#: lags real time by up to a scheduler tick (4-10 ms).
FINE_MARGIN_NS = 20_000_000


@dataclass(frozen=True)
class DigestedFile:
    """One file as its digest saw it: the name in the model's directory and
    the ``fstat`` of the descriptor its bytes were read through."""

    path: Path
    st: os.stat_result


def _process_start_ns() -> int | None:
    """This process's start in wall-clock nanoseconds (Linux), rounded down."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return (boot * 1_000_000_000) + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def engine_started_ns(vllm_config: Any) -> tuple[int | None, str]:
    """A wall-clock time before vLLM read any weight, and where it came from."""
    stamp = str(getattr(vllm_config, "instance_id", "") or "")
    m = re.match(r"(\d{18,20})(?:_|$)", stamp)  # time.time_ns(), maybe "_dp<rank>"
    if m and int(m.group(1)) <= time.time_ns():
        return int(m.group(1)), "the engine's configuration"
    start = _process_start_ns()
    return start, "this process's start" if start is not None else "nothing"


def _margin(st: os.stat_result) -> int:
    coarse = st.st_ctime_ns % 1_000_000_000 == 0 and st.st_mtime_ns % 1_000_000_000 == 0
    return COARSE_MARGIN_NS if coarse else FINE_MARGIN_NS


def _changed_since(what: str, st: os.stat_result, since_ns: int) -> str | None:
    last = max(st.st_mtime_ns, st.st_ctime_ns)
    if last >= since_ns - _margin(st):
        return f"{what} changed {(last - since_ns) / 1e9:+.2f} s after the engine started"
    return None


def _chain(path: Path) -> list[Path]:
    """``path``, then each link it goes through and the final target (a hub
    snapshot links to its blobs), as absolute paths."""
    out, seen = [Path(os.path.abspath(path))], set()
    while out[-1].is_symlink() and out[-1] not in seen and len(out) < 40:
        seen.add(out[-1])
        out.append(Path(os.path.abspath(out[-1].parent / os.readlink(out[-1]))))
    return out


def first_change(source: Path, files: Iterable[DigestedFile], since_ns: int) -> str | None:
    """Why the digested ``files`` of ``source`` may not be what was loaded
    after ``since_ns``: the first change found (a file, a link or a directory
    entry), or None when nothing changed."""
    dirs: dict[Path, None] = {}
    if source.is_dir():
        dirs[Path(os.path.abspath(source))] = None
    for f in files:
        why = _changed_since(f"{f.path.name}", f.st, since_ns)
        if why:
            return why
        try:
            now = os.stat(f.path)
        except OSError as exc:
            return f"{f.path.name} cannot be read any more ({exc.strerror})"
        if (now.st_dev, now.st_ino) != (f.st.st_dev, f.st.st_ino):
            return f"{f.path.name} was replaced after its digest"
        for link in _chain(f.path):
            dirs[link.parent] = None
            if link.is_symlink():
                why = _changed_since(f"the link {link}", os.lstat(link), since_ns)
                if why:
                    return why
    for d in dirs:
        try:
            why = _changed_since(f"the directory {d}", os.stat(d), since_ns)
        except OSError as exc:
            return f"the directory {d} cannot be read ({exc.strerror})"
        if why:
            return why
    return None
